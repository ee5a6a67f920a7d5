import sys, time, contextlib, torch
sys.path.insert(0, '.')
from dayzero.models import load_model
from dayzero.ops import REGISTRY
from torch.profiler import profile, ProfilerActivity
path = sys.argv[1]
m = load_model(path, device="cuda", dtype=torch.bfloat16, progress=False)
g = torch.Generator().manual_seed(3)
ids = torch.randint(10, 200000, (1, 128), generator=g).cuda()
pos = torch.arange(128, device="cuda")[None]
def run():
    with torch.no_grad():
        return m(ids, pos)[0].float()
@contextlib.contextmanager
def no_kernels(*names):
    saved = {n: REGISTRY.get(n).kernels for n in names}
    for n in names: REGISTRY.get(n).kernels = []
    try: yield
    finally:
        for n, k in saved.items(): REGISTRY.get(n).kernels = k
def err(a, b): return float(((a-b).abs().amax(-1)/b.abs().amax(-1)).median())
default = run()
with REGISTRY.force_backend("reference"):
    ref = run()
print("kernels vs reference", err(default, ref), flush=True)
for op in ("paged_gqa_attention", "moe_experts_mxfp4", "route_softmax_topk"):
    with no_kernels(op):
        print(f"without {op} kernel vs reference", err(run(), ref), flush=True)
# timing a 8192-token prefill through the model (LocalCache), profiled
ids2 = torch.randint(10, 200000, (1, 8192), generator=g).cuda(); pos2 = torch.arange(8192, device="cuda")[None]
for rep in range(2):
    torch.cuda.synchronize(); t = time.perf_counter()
    with torch.no_grad(): m(ids2, pos2)
    torch.cuda.synchronize(); print("8192-token forward s", time.perf_counter() - t, flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    with torch.no_grad(): m(ids2, pos2)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
del m; torch.cuda.empty_cache()
from transformers import AutoModelForCausalLM
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
with torch.no_grad(): theirs = hf(ids).logits[0].float()
print("reference vs transformers", err(ref, theirs), "kernels vs transformers", err(default, theirs))
hf32 = None

"""The kernel library: one package per op family, each registering its public ops' kernels with the
registry (dayzero/ops/registry.py) beside the reference ops, for CUDA.

    attention/ paged attention over the KV pool (paged_gqa_attention, paged_mla_attention)
    moe/      routed experts (moe_experts_mxfp4 / bf16 / fp8): dispatch, the GEMM kernels, path B's FP8
              workspace, the layer graphs; moe/choose.py picks the kernel and its tiles per call
    token/    per-token layer ops (rms_norm, add_rms_norm, rope, rope_kv_write) in one launch each
    routing/  top-k routing for every routing op (softmax, sigmoid + bias + group limit, sqrtsoftplus, hash)
    dsa/      DeepSeek Sparse Attention: the paged lightning indexer and its top-k (paged_index_topk)
    kda/      KDA (kda_chunk, kda_recurrent) through fla-core where it is installed (backend "fla")
    gdn/      Gated DeltaNet (gdn_chunk, gdn_recurrent and their varlen / slot forms) through fla-core (backend "fla")
    hc/       DeepSeek-V4's hyper-connections (hyper_connection, hyper_connection_post), one launch each
    v4/       DeepSeek-V4 attention: the compressor (kv_compressor) in one launch
    linear/   dense projections with FP8 block-scaled weights (linear_fp8_block)
    vision/   the vision encoder's packed bidirectional attention (varlen_attention) through torch's kernels
Shared by the families: devices.py (device facts looked up once), pdl.py (programmatic dependent
launch), checks.py (argument checks, `supports` predicates). Importing registers every kernel without
importing Triton (that happens at a kernel's first call). See docs/kernels.md.
"""

from dayzero.kernels import attention, dsa, gdn, hc, kda, linear, moe, routing, token, v4, vision  # noqa: F401  (register their kernels)

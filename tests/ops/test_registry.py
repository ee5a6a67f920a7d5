import pytest
import torch

from dayzero.ops.registry import REFERENCE, Registry


def _registry_with_kernels():
    reg = Registry()
    op = reg.define("scale", lambda x, k: x * k, "multiply by k")
    reg.register_kernel("scale", lambda x, k: ("fast", x * k), backend="fast", devices=["cpu"], priority=20)
    reg.register_kernel(
        "scale",
        lambda x, k: ("picky", x * k),
        backend="picky",
        devices=["cpu"],
        priority=30,
        supports=lambda x, k: x.shape[-1] % 4 == 0,
    )
    reg.register_kernel("scale", lambda x, k: ("gpu", x), backend="gpu_only", devices=["cuda"], priority=99)
    reg.register_kernel("scale", lambda x, k: ("gone", x), backend="gone", devices=["cpu"], priority=50, available=lambda: False)
    return reg, op


def test_highest_priority_available_supported_kernel_wins():
    reg, op = _registry_with_kernels()
    x = torch.randn(2, 8)
    tag, out = op(x, 3.0)
    assert tag == "picky"  # "gone" is unavailable, "gpu_only" does not run on cpu
    torch.testing.assert_close(out, x * 3.0)


def test_supports_predicate_falls_through_to_next_kernel():
    reg, op = _registry_with_kernels()
    tag, _ = op(torch.randn(2, 6), 2.0)
    assert tag == "fast"


def test_forced_reference_and_missing_forced_backend():
    reg, op = _registry_with_kernels()
    x = torch.randn(2, 8)
    with reg.force_backend(REFERENCE):
        torch.testing.assert_close(op(x, 2.0), x * 2.0)
    with reg.force_backend("gpu_only"):
        with pytest.raises(RuntimeError, match="no 'gpu_only' implementation for device 'cpu'"):
            op(x, 2.0)


def test_the_backend_setting_forces_backend():
    from dayzero import settings

    reg, op = _registry_with_kernels()
    with settings.override(backend="fast"):  # DAYZERO_BACKEND=fast
        assert op(torch.randn(1, 8), 1.0)[0] == "fast"
    assert op(torch.randn(1, 8), 1.0)[0] == "picky"


def test_kernel_variants_are_listed_and_checked():
    from dayzero import settings

    reg, _ = _registry_with_kernels()
    reg.define("gemm", lambda x: x)
    reg.register_kernel("gemm", lambda x: x, backend="fast", devices=["cpu"],
                        variants={"tiled": "tiles of 64", "split": "K split in two"})
    assert reg.variants("gemm") == {"fast": {"tiled": "tiles of 64", "split": "K split in two"}}
    assert reg.variants("scale") == {}
    table = reg.coverage_table(["gemm", "scale"])
    assert "gemm [fast]" in table and "split  K split in two" in table
    with settings.override(variants={"gemm": "split"}):
        reg.check_variants()
    with settings.override(variants={"gemm": "splat"}):
        with pytest.raises(ValueError, match="gemm=splat; gemm has variants split, tiled"):
            reg.check_variants()


def test_backends_and_coverage_table():
    reg, _ = _registry_with_kernels()
    assert reg.backends_for("scale") == [REFERENCE, "gpu_only", "gone", "picky", "fast"]
    assert reg.backends_for("nope") == []
    table = reg.coverage_table(["scale", "nope"])
    lines = table.splitlines()
    assert lines[0].split() == ["op", REFERENCE, "fast", "gone", "gpu_only", "picky"]
    assert "unavailable here" in table
    assert lines[-1].split() == ["nope", "MISSING"]


def test_definition_errors():
    reg, _ = _registry_with_kernels()
    with pytest.raises(ValueError, match="already defined"):
        reg.define("scale", lambda x: x)
    with pytest.raises(ValueError, match="already has a 'fast' kernel"):
        reg.register_kernel("scale", lambda x: x, backend="fast", devices=["cpu"])
    with pytest.raises(KeyError, match="unknown op 'missing'; defined ops: scale"):
        reg.register_kernel("missing", lambda x: x, backend="b", devices=["cpu"])


def test_builtin_ops_are_defined_with_reference():
    from dayzero import ops

    for name in ["embedding", "rms_norm", "layer_norm", "rope", "swiglu", "swiglu_clamped", "linear", "linear_fp8_block", "linear_mxfp4", "mxfp4_dequantize", "mxfp4_to_fp8"]:
        assert ops.backends_for(name)[0] == REFERENCE


def test_record_calls_counts_outermost_ops_only():
    reg = Registry()
    inner = reg.define("inner", lambda x: x + 1)
    outer = reg.define("outer", lambda x: inner(x) * 2)
    with reg.record_calls() as calls:
        outer(torch.ones(1))
        outer(torch.ones(1))
        inner(torch.ones(1))
    assert calls == {"outer": 2, "inner": 1}
    outer(torch.ones(1))  # not recorded after the block
    assert calls == {"outer": 2, "inner": 1}
    with reg.record_calls(by_backend=True) as calls:
        outer(torch.ones(1))
    assert calls == {"outer@reference": 1}


def test_selected_backend_without_arguments_skips_supports_checks():
    reg, _ = _registry_with_kernels()
    assert reg.selected_backend("scale", "cpu") == "picky"  # its supports() needs the call's arguments
    assert reg.selected_backend("scale", "cuda") == "gpu_only"

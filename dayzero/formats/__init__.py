"""Number formats: MXFP4 (three on-disk layouts), block-scaled FP8 E4M3, and MXFP4 -> FP8 folding.

No model knowledge lives here; docs/formats.md has the layouts, rules and sources."""

from dayzero.formats import fp8, mxfp4, mxfp4_fp8

__all__ = ["fp8", "mxfp4", "mxfp4_fp8"]

"""Human-readable sizes: memory in binary units (GiB), parameter counts in decimal units."""


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_gib(gib: float) -> str:
    return format_bytes(gib * (1 << 30))


def format_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3f} {unit}" if unit == "T" else f"{n / size:.2f} {unit}"
    return f"{n:.0f}"

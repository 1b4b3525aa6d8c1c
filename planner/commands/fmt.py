"""Human-readable numbers for CLI tables."""

from __future__ import annotations


def si(x: float, unit: str = "", base: float = 1000.0) -> str:
    """At most 3 significant digits with an SI prefix: si(1.3e9, "FLOP") -> "1.3 GFLOP";
    base 1024 for binary prefixes (1000 KiB reads "0.977 MiB", never "1e+03 KiB")."""
    prefixes = (
        ["", "K", "M", "G", "T", "P", "E"]
        if base == 1000.0
        else ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
    )
    i = 0
    x = float(x)
    # 3 significant digits print a value that rounds to 1000 or more as "1e+03"
    while i < len(prefixes) - 1 and (abs(x) >= base or abs(float(f"{x:.3g}")) >= 1000):
        x /= base
        i += 1
    return f"{x:.3g} {prefixes[i]}{unit}".rstrip()


def param_count(n: float) -> str:
    """A parameter count as people write it: 70.55 B, 124.4 M, 14.3 K."""
    for scale, suffix, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {suffix}"
    return f"{n:.0f}"


def nbytes(x: float) -> str:
    return si(x, "B", 1024.0)


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain left-aligned text table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])

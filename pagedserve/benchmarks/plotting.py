"""matplotlib for the bench commands that draw plots (compare, chunked-itl, latency sweeps).

An optional dependency (`pip install "pagedserve[plot]"`): nothing on the serving path imports it, and a bench
command that plots asks for it before it measures, so a missing install fails in a second, not after the run.
"""
from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend; ImportError naming the extra when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError('this bench command draws plots and needs matplotlib: pip install "pagedserve[plot]"') from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

"""loadtest/bench_kernel_ab.py: the kernel against another version of its source, outputs compared bit for bit."""
from __future__ import annotations

from loadtest import bench_kernel_ab
from specserve.server.models import paged_kernel


def test_the_same_source_gives_the_same_bits_and_a_changed_one_does_not(tmp_path):
    rows = bench_kernel_ab.main([str(paged_kernel.SOURCE), "--rounds", "1", "--calls", "1", "--context", "40"])
    assert len(rows) == 12 and all(r["same_bits"] and r["other_us"] > 0 for r in rows)
    layered = bench_kernel_ab.main([str(paged_kernel.SOURCE), "--rounds", "1", "--calls", "1", "--context", "40",
                                    "--layers", "2"])                 # caches of their own, a linear between
    assert len(layered) == 12 and all(r["same_bits"] and r["current_us"] > 0 for r in layered)
    text = paged_kernel.SOURCE.read_text()
    assert "window, scale, out};" in text
    changed = tmp_path / "changed.cpp"
    changed.write_text(text.replace("window, scale, out};", "window, scale * 1.001f, out};"))   # scores 0.1 % larger
    rows = bench_kernel_ab.main([str(changed), "--rounds", "1", "--calls", "1", "--context", "40"])
    assert not any(r["same_bits"] for r in rows)
    assert paged_kernel.load() is paged_kernel._state["lib"]                        # the current kernel is back

"""course_lib.trace (per-rank event recording) and course_lib.viz.plot_timeline."""

from __future__ import annotations

import time

import matplotlib

matplotlib.use("Agg")

import pytest

from course_lib import trace, viz
from course_lib.launch import run

KEYS = {"rank", "kind", "name", "start", "end", "bytes_sent", "bytes_recv"}


def test_current_is_set_only_while_active_and_nests():
    assert trace.current() is None
    with trace.Recorder(rank=3) as outer:
        assert trace.current() is outer and outer.rank == 3
        with trace.Recorder(rank=3) as inner:
            assert trace.current() is inner
            inner.comm("x", 8, 4, inner.now(), inner.now())
        assert trace.current() is outer
        assert outer.totals()["n_comm"] == 0, "only the innermost recorder receives reports"
    assert trace.current() is None


def test_current_is_cleared_after_an_exception():
    with pytest.raises(KeyError):
        with trace.Recorder():
            raise KeyError("boom")
    assert trace.current() is None


def test_rank_defaults_to_zero_without_a_process_group():
    with trace.Recorder() as rec:
        pass
    assert rec.rank == 0


def test_span_and_comm_events_and_totals():
    with trace.Recorder(rank=1) as rec:
        with rec.span("compute", "forward"):
            time.sleep(0.002)
        t0 = time.perf_counter()
        rec.comm("a", 100, 40, t0, time.perf_counter(), peer=2)   # perf_counter readings
        w0 = time.time()
        rec.comm("b", 1, 2, w0, time.time())                      # wall-clock readings
    ev = rec.events
    assert [e["name"] for e in ev] == ["forward", "a", "b"]
    assert all(KEYS <= set(e) for e in ev)
    assert ev[0]["kind"] == "compute" and ev[0]["bytes_sent"] == 0
    assert ev[0]["end"] - ev[0]["start"] >= 0.002
    assert ev[1]["peer"] == 2
    # every time is on one wall-clock scale, in recording order
    assert all(abs(e["start"] - time.time()) < 60 for e in ev)
    assert ev[0]["end"] <= ev[1]["start"] <= ev[1]["end"] <= ev[2]["start"] + 1e-3
    assert rec.totals() == {"bytes_sent": 101, "bytes_recv": 42, "n_comm": 2}
    rec.clear()
    assert rec.totals() == {"bytes_sent": 0, "bytes_recv": 0, "n_comm": 0} and rec.events == []


def test_comm_rejects_bad_values():
    rec = trace.Recorder()
    with pytest.raises(ValueError, match=">= 0"):
        rec.comm("x", -1, 0, 0.0, 1.0)
    with pytest.raises(ValueError, match="before it starts"):
        rec.comm("x", 1, 0, 2.0, 1.0)


def _causal(rank, world_size):
    """Rank 0 records an event, then sends; rank 1 records after receiving: clocks must agree."""
    import torch
    import torch.distributed as dist

    with trace.Recorder() as rec:
        t = torch.zeros(1)
        if rank == 0:
            with rec.span("compute", "before send"):
                time.sleep(0.01)
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
            with rec.span("compute", "after recv"):
                pass
    return rec.events


def test_events_of_different_ranks_share_one_clock():
    ev0, ev1 = run(_causal, 2)
    assert ev0[0]["rank"] == 0 and ev1[0]["rank"] == 1  # rank read from the process group
    # causality: what rank 1 did after the message cannot appear to start before rank 0 sent it
    assert ev1[0]["start"] >= ev0[0]["end"]


def test_plot_timeline_draws_one_row_per_rank():
    now = time.time()
    events = [[dict(rank=r, kind=k, name=f"{k}{r}", start=now + 0.01 * i, end=now + 0.01 * i + 0.005,
                    bytes_sent=0, bytes_recv=0) for i, k in enumerate(["compute", "comm", "wait"])]
              for r in range(3)]
    ax = viz.plot_timeline(events, title="t", label_events=True)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 2", "rank 1", "rank 0"]
    assert ax.get_title() == "t" and "ms" in ax.get_xlabel()
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"compute", "comm", "wait"}
    assert ax.get_xlim()[1] == pytest.approx(25 * 1.01, rel=1e-3)  # ms since the first start
    assert len(ax.collections) == 9


def test_plot_timeline_colours_the_vocabulary_the_same_whatever_comes_first():
    """compute, comm and the pipeline's forward/backward/weight have fixed colours; other kinds take
    the colours no kind has, in order of appearance."""
    from matplotlib.colors import to_hex
    now = time.time()
    kinds = ["relabelled", "backward", "comm", "forward", "other", "compute"]
    events = [[dict(rank=0, kind=k, name=k, start=now + i, end=now + i + 0.5, bytes_sent=0, bytes_recv=0)
               for i, k in enumerate(kinds)]]
    ax = viz.plot_timeline(events)
    got = {k: to_hex(c.get_facecolor()[0]) for k, c in zip(kinds, ax.collections)}
    for k in ("compute", "comm", "forward", "backward"):
        assert got[k] == to_hex(viz.KIND_COLORS[k]), k
    assert got["relabelled"] == to_hex("tab:green")
    assert len(set(got.values())) == len(kinds)


def test_plot_timeline_without_events_is_a_clear_error():
    with pytest.raises(ValueError, match="no events"):
        viz.plot_timeline([[], []])


def test_show_prints_library_source_from_a_given_line(capsys):
    from course_lib import viz

    viz.show(viz.show)
    assert capsys.readouterr().out.startswith("def show(*objs, start")
    viz.show(viz.show, viz._new_ax, start="    import")
    out = capsys.readouterr().out
    assert out.startswith("    import inspect") and "    import matplotlib.pyplot as plt" in out
    with pytest.raises(ValueError, match="'nowhere' is not in the source of show"):
        viz.show(viz.show, start="nowhere")


def test_show_without_body_prints_signature_and_docstring_only(capsys):
    from course_lib import viz

    viz.show(viz.show, body=False)
    out = capsys.readouterr().out
    assert out.startswith("def show(*objs, start") and '"""Print the source' in out
    assert out.rstrip().endswith('"""\n    ...') and "import inspect" not in out
    viz.show(viz._new_ax, body=False)          # no docstring: the signature and ...
    assert capsys.readouterr().out == "def _new_ax(ax, figsize):\n    ...\n\n"

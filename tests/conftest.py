"""Options of the course's test suite, and the order in which its files go to the workers."""

from pathlib import Path

# `make test` runs every test file and lecture notebook in one pytest run on two pytest-xdist workers,
# a whole file per worker at a time (`--dist loadfile`). The files go out longest first (the classic
# longest-processing-time-first rule): the known-wrong runs (a third of a worker's time) start at once
# instead of halfway through, and the run does not end with one worker on a long file while the other has
# nothing left. Seconds per file from one `--durations=0` run of the suite on 2 cores shared with other
# work (2026-12-05, about twice CI's times; the grader files and 12 after that day's cuts, 10's kernel had
# failed to start in that run: estimated). A notebook not listed counts as 100 s (a new lecture is
# rarely quick), any other file as 0 s; ties keep the collection order. The numbers only order the
# files: a stale one costs time, never a test.
SECONDS = {
    "test_known_wrong.py": 600, "12_fault_tolerance.ipynb": 220, "04_data_parallel.ipynb": 204,
    "13_scaling_laws.ipynb": 158, "15_long_context.ipynb": 135, "01_compute_and_memory.ipynb": 131,
    "test_launch.py": 131, "03_collectives.ipynb": 113, "11_activation_checkpointing.ipynb": 110,
    "02_mixed_precision.ipynb": 103, "10_mixture_of_experts.ipynb": 100, "14_putting_it_together.ipynb": 92,
    "test_multinode.py": 90, "test_mesh.py": 89, "test_grading.py": 85, "08_pipeline_parallel.ipynb": 79,
    "00_setup.ipynb": 72, "test_collectives.py": 67, "test_fault.py": 60, "09_hybrid_parallel.ipynb": 56,
    "test_frontier.py": 53, "test_pipeline.py": 53, "test_zero.py": 50, "test_browser.py": 45,
    "06_zero_and_fsdp.ipynb": 40, "test_slurm.py": 37, "test_grading_server.py": 35,
    "07_tensor_parallel.ipynb": 32, "test_estimate.py": 29, "test_widgets.py": 27, "test_moe.py": 23,
    "test_context_parallel.py": 23, "05_gradient_accumulation.ipynb": 22, "test_netem.py": 14,
    "test_recompute.py": 12, "test_data_parallel.py": 12, "test_scaling.py": 12,
    # added later the same day, estimated at the same scale (not from a run of the whole suite):
    "16_hiding_communication.ipynb": 120, "test_overlap.py": 30, "test_precision.py": 15,
}
UNLISTED_NOTEBOOK_SECONDS = 100


def seconds(path) -> float:
    name = Path(str(path)).name
    return SECONDS.get(name, UNLISTED_NOTEBOOK_SECONDS if name.endswith(".ipynb") else 0)


def pytest_addoption(parser):
    parser.addoption("--course-wheel", default=None, metavar="WHL",
                     help="the wheel that the environment running the tests was installed from "
                          "(`make test` passes it; tests/test_wheel.py then checks that nothing is "
                          "imported from the repository and reuses the wheel)")


def pytest_configure(config):
    # pytest-xdist >= 3.6 would otherwise re-sort the files by their number of tests (a notebook's cells
    # count as tests), which puts long files with few tests, such as the known-wrong runs, anywhere.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Longest files first; a file's items stay together and in their order (a notebook's cells share
    one kernel), ties keep the collection order."""
    items.sort(key=lambda item: -seconds(item.path))

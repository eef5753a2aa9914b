"""The order ``make test``'s parallel phase hands test files to its two workers: the slowest first.

pytest-xdist's ``--dist loadfile`` gives a worker one whole file at a time (its module-scoped
servers are shared), by default the files with the most tests first (``--loadscope-reorder``),
and a worker asks for its next file while its current one still has 2 tests to run. A file of a
few slow tests (the benchmark smoke run, the interrupt matrix, the cluster) then comes near the
end, and one worker runs it (or two such files, one queued behind the other) while the other
worker has nothing left: the phase lasts as long as its slower worker. Handed out slowest first
(longest processing time first), the long files overlap and the many short ones even out the
ends. The Makefile passes ``--no-loadscope-reorder`` so that xdist keeps this order.

:data:`SECONDS` is each file's time on one worker (its tests' set-up, calls and tear-down summed),
from a suite run on the shared 2-core machine under a load of ~10 (about 5x a quiet CI run's
figures; test_readme.py's scaled from a CI run): only the order matters.
A file not listed comes after the listed ones, the files with more tests first (xdist's own
order): a new slow file still runs, only not first; add it here when it shows in the durations.
"""
from __future__ import annotations

#: seconds of a file on one worker (relative figures: see the module's docstring)
SECONDS = {  # file: seconds
    "test_benchmarks.py": 238, "test_docs_snippets.py": 280, "test_server_budget.py": 273,
    "test_hf_auto_families.py": 226, "test_benchmarks_baselines.py": 106, "test_client_interrupt.py": 147,
    "test_hf_modeling.py": 135, "test_recovery.py": 68, "test_analysis_families.py": 127,
    "test_hf_applies.py": 124, "test_openapi.py": 60, "test_client_cli.py": 88, "test_cluster.py": 35,
    "test_hf_journal.py": 93, "test_privacy_families.py": 105, "test_client_cli_runs.py": 42,
    "test_transport_unix.py": 92, "test_cluster_splitfed.py": 34, "test_privacy_attacks.py": 78,
    "test_privacy_finetune.py": 78, "test_hf_auto_lora.py": 76, "test_client_generation.py": 74,
    "test_readme.py": 35, "test_hf_draft.py": 70, "test_packed.py": 68, "test_hf_pipeline.py": 66,
    "test_packaging.py": 58, "test_hf_family_generation.py": 55, "test_hf_generation.py": 53,
    "test_train_requests.py": 52, "test_offload_families.py": 51, "test_client_families.py": 48,
    "test_federation.py": 45, "test_privacy_secret.py": 42, "test_arch.py": 41,
    "test_hf_family_federation.py": 39, "test_client.py": 39, "test_hf_auto.py": 38, "test_layers.py": 36,
    "test_hf_cache.py": 36, "test_hf_family_draft.py": 36, "test_client_lora.py": 34,
    "test_privacy_meter.py": 33, "test_hf_auto_recovery.py": 33, "test_hf_unsplit.py": 32,
    "test_hf_family_pipeline.py": 32, "test_server_memory.py": 31, "test_privacy_defenses.py": 31,
    "test_piece_race.py": 30, "test_analysis_cli.py": 29, "test_server_app.py": 28,
    "test_hf_auto_trainer.py": 27, "test_hf_family_defenses.py": 26, "test_server_lease_fair.py": 26,
    "test_export.py": 25, "test_server_batching_families.py": 24, "test_server_families.py": 23,
    "test_analysis_leakage.py": 23, "test_server_optimizer_walls.py": 21, "test_examples.py": 20,
    "test_analysis_counting.py": 20,
}


def ordered(items: list) -> list:
    """``items`` (pytest's collection) with the files in :data:`SECONDS` first, slowest first,
    then the others by their number of tests; the tests of one file keep their order."""
    def name(item) -> str:
        return item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]

    counts: dict[str, int] = {}
    for item in items:
        counts[name(item)] = counts.get(name(item), 0) + 1

    def key(item) -> tuple:
        n = name(item)
        return (0, -SECONDS[n], n) if n in SECONDS else (1, -counts[n], n)

    return sorted(items, key=key)  # stable: a file's tests stay in their order

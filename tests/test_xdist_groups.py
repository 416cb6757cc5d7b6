"""How `make test` splits the suite over two processes (tests/conftest.py): the live stacks and
namespaces never run beside each other, the session engine starts once, a module stays whole."""

from __future__ import annotations

from tests.conftest import ENGINE_FIXTURE, SERIAL_GROUP, engine_modules, xdist_group


def test_stacks_and_namespaces_share_one_group_and_run_one_after_another() -> None:
    for nodeid in (
        "tests/e2e/test_worker_faults.py::test_sigterm_drains_within_its_bound",
        "tests/e2e/test_multi_host.py::test_a_batch_spans_hosts_survives_losing_one_and_takes_it_back",
        "tests/infra/test_netns.py::test_x[a@b]",
        "tests/infra/test_first_hour.py::test_make_run_then_the_printed_path_then_the_cli",
    ):
        assert xdist_group(nodeid) == SERIAL_GROUP, nodeid


def test_the_session_engines_modules_share_one_group() -> None:
    modules = engine_modules()
    assert "tests/workers/test_engine.py" in modules and "tests/workers/test_cache_isolation.py" in modules
    assert "tests/workers/test_dispatcher.py" not in modules  # a worker test without the engine
    assert {xdist_group(f"{m}::test_x[sqlite]") for m in modules} == {ENGINE_FIXTURE}


def test_any_other_module_is_a_group_of_its_own() -> None:
    assert xdist_group("tests/api/test_v1.py::test_a[sqlite]") == "tests/api/test_v1.py"
    assert xdist_group("tests/api/test_v1.py::TestX::test_b") == "tests/api/test_v1.py"
    assert xdist_group("tests/test_layers.py::test_no_import_cycles") == "tests/test_layers.py"
    # a top-level file whose name starts like a serial package is not in it
    assert xdist_group("tests/test_docs.py::test_x") == "tests/test_docs.py"

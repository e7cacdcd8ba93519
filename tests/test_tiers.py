"""conftest.TIERS names tests that exist, with tags that mean something: a renamed test must not
silently leave the slow tier (or lose its root or GPU skip)."""
from __future__ import annotations

import ast
from pathlib import Path

import conftest
import pytest
from conftest import MARKERS, NEEDS, TIERS

TESTS = Path(__file__).resolve().parent


def _test_functions(module: str) -> set[str]:
    tree = ast.parse((TESTS / module).read_text())
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


@pytest.mark.parametrize("key", sorted(TIERS))
def test_each_key_names_a_module_or_test_that_exists(key):
    module, _, name = key.partition("::")
    assert (TESTS / module).is_file(), f"{key}: no module {module}"
    if name:
        assert name.split("[")[0] in _test_functions(module), f"{key}: no such test"


@pytest.mark.parametrize("key", sorted(conftest.LONG_TESTS))
def test_each_long_test_exists_and_is_slow(key):
    module, _, name = key.partition("::")
    assert name in _test_functions(module), f"{key}: no such test"
    assert "slow" in conftest.tags_of_nodeid(f"tests/{key}"), f"{key}: long, so slow"


@pytest.mark.parametrize("key", sorted(TIERS))
def test_each_tag_is_a_marker_or_a_need(key):
    assert TIERS[key] <= set(MARKERS) | set(NEEDS) | conftest.MACHINE_TAGS, key


#: for every module of bpsctl/, a test of the fast tier that runs its code (in the test's
#: process or in the processes it starts): `python -m pytest -m "not slow"` then exercises all
#: of bpsctl, and a module whose last fast test moves to `slow` fails the check below
#: the fast test of Horovod's API, on a job of one worker
HOROVOD_OF_ONE = "test_small_parts.py::test_horovods_collectives_of_one_worker_give_its_own_tensors"

FAST_TEST_OF = {
    "__init__.py": "test_cli.py::test_status_without_a_cluster",
    "chaos/__init__.py":
        "test_chaos.py::test_the_recorder_writes_what_the_checker_reads_only_under_bpsctl_chaos",
    "chaos/api.py":
        "test_chaos.py::test_the_checker_finds_ranks_that_differ_stalls_and_a_drifted_model",
    "chaos/cli.py": "test_chaos.py::test_the_chaos_table_names_each_fault_and_each_invariant",
    "chaos/faults.py": "test_chaos.py::test_a_collapse_needs_a_shaped_nic_and_a_kind_is_checked",
    "chaos/job.py":
        "test_chaos.py::test_the_job_is_the_same_in_every_run_and_each_rank_gets_its_own_batches",
    "chaos/schedule.py":
        "test_chaos.py::test_a_seed_gives_the_same_schedule_and_every_schedule_keeps_its_rules",
    "bench/shapes.py":
        "test_small_parts.py::test_the_benchs_shapes_are_its_models_and_fuse_into_the_same_pushes",
    "bench/allreduce.py":
        "test_small_parts.py::test_the_allreduce_baseline_checks_its_sum_and_reports_its_rounds",
    "bench/api.py": "test_bench_comm.py::test_comm_bench_reports_design_keys_and_leaves_nothing",
    "bench/cli.py": "test_bench_comm.py::test_comm_bench_bad_flags_exit_2_naming_the_flag",
    "bench/codec.py": "test_small_parts.py::test_the_codec_benchmark_states_each_compressors_bytes",
    "bench/common.py": "test_bench_train.py::test_horovod_env_follows_horovodruns_gloo_launcher",
    "bench/collectives.py": "test_bench_comm.py::"
        "test_each_collectives_result_is_checked_against_what_each_rank_must_get",
    "bench/comm.py": "test_bench_comm.py::test_comm_bench_reports_design_keys_and_leaves_nothing",
    "bench/convergence.py":
        "test_stragglers.py::test_the_convergence_task_is_the_same_everywhere_and_learnable",
    "bench/gpu.py": "test_paths.py::test_the_device_is_cuda_only_where_every_worker_host_has_a_gpu",
    "bench/grads.py": "test_small_parts.py::test_the_per_tensor_benchmark_pushes_resnet50s_tensors",
    "bench/horovod.py": "test_bench_train.py::test_patch_raises_the_cxx_standard",
    "bench/install.py": "test_small_parts.py::test_install_horovod_says_what_it_builds",
    "bench/load.py":
        "test_load.py::test_the_gradient_set_is_resnet50s_at_full_scale_and_keeps_its_161_tensors_scaled",
    "bench/models.py": "test_bench_train.py::test_models_have_torchvisions_parameter_shapes",
    "bench/profile.py":
        "test_replay.py::test_profile_records_every_parameter_in_registration_order",
    "bench/replay.py":
        "test_replay.py::test_the_stand_in_fires_each_hook_in_the_recorded_order_never_early",
    "bench/report.py":
        "test_bench_output.py::test_train_table_fits_80_columns_and_says_slower_on_loopback",
    "bench/train.py": "test_bench_train.py::test_horovod_env_follows_horovodruns_gloo_launcher",
    "bench/training.py": "test_bench_train.py::test_unknown_baseline_is_a_usage_error",
    "cli.py": "test_cli.py::test_usage_errors_exit_2_and_name_the_flag",
    "cliutil.py": "test_cli.py::test_bad_environment_is_a_config_error",
    "config.py": "test_config.py::test_bpsctl_variables_are_parsed_by_kind",
    "engine/basics.py": HOROVOD_OF_ONE,
    "engine/fusion.py":
        "test_small_parts.py::test_the_benchs_shapes_are_its_models_and_fuse_into_the_same_pushes",
    "engine/__init__.py":
        "test_cli.py::test_the_command_line_and_the_schedulers_supervisor_start_without_numpy",
    "engine/api.py":
        "test_bench_comm.py::test_comm_bench_reports_design_keys_and_leaves_nothing",
    "engine/byteps.py":
        "test_bpslaunch.py::test_every_byteps_knob_of_env_md_is_honoured_or_named_as_ignored",
    "engine/dmlc.py":
        "test_bpslaunch.py::test_each_bad_dmlc_variable_is_named_with_what_it_should_be",
    "engine/client.py":
        "test_trace.py::test_a_clock_exchange_needs_the_secret_and_bounds_the_true_offset",
    "engine/cuda.py": "test_small_parts.py::"
        "test_a_cuda_array_is_told_apart_and_without_cupy_the_error_says_how_to_get_it",
    "engine/collectives.py":
        "test_horovod_api.py::test_reducescatter_splits_rows_as_horovod_does",
    "engine/common.py": "test_engine.py::test_sum_is_exact_for_integer_valued_data",
    "engine/compression.py":
        "test_compression.py::test_each_compressor_sends_exactly_its_stated_size",
    "engine/intranode.py": "test_paths.py::test_every_rank_takes_the_same_nccl_decision",
    "engine/mxnet/__init__.py": "test_horovod_mxnet.py::test_a_horovod_mxnet_script_on_one_worker",
    "engine/mxnet/mpi_ops.py": "test_horovod_mxnet.py::test_a_horovod_mxnet_script_on_one_worker",
    "engine/mxnet/ops.py": "test_horovod_mxnet.py::test_a_horovod_mxnet_script_on_one_worker",
    "engine/pacing.py":
        "test_pacing.py::test_unequal_shares_bound_the_bytes_in_flight_by_the_pacing_window",
    "engine/partition.py": "test_engine.py::test_sizes_the_partition_size_does_not_divide",
    "engine/paths.py":
        "test_paths.py::test_one_worker_sends_nothing_unless_forced_and_gets_the_same_sums",
    "engine/process_sets.py": HOROVOD_OF_ONE,
    "engine/protocol.py": "test_torch_bf16.py::test_round_and_widen_match_torch_conversions",
    "engine/scheduler.py": "test_engine.py::test_sum_is_exact_for_integer_valued_data",
    "engine/security.py": "test_security.py::test_a_worker_with_the_wrong_secret_cannot_register",
    "engine/server.py": "test_engine.py::test_sum_is_exact_for_integer_valued_data",
    "engine/shm.py":
        "test_shm_local.py::test_an_arena_is_0600_named_for_its_cluster_and_job_and_gone_once_all_attached",
    "engine/shmlink.py":
        "test_shm_server.py::test_segments_are_0600_and_named_for_the_cluster_job_and_server",
    "engine/supervise.py": "test_launch.py::test_up_status_down_leaves_nothing",
    "engine/torch/__init__.py": "test_torch_plugin.py::test_api",
    "engine/torch/compression.py": "test_torch_plugin.py::test_api",
    "engine/torch/cuda_copies.py":
        "test_staging.py::test_a_result_read_where_it_arrived_lands_whole_and_divided",
    "engine/torch/functions.py": "test_torch_plugin.py::test_api",
    "engine/torch/gradients.py": "test_torch_plugin.py::test_api",
    "engine/torch/ops.py": "test_torch_plugin.py::test_api",
    "engine/torch/plugin.py": "test_torch_plugin.py::test_api",
    "engine/torch/basics.py": HOROVOD_OF_ONE,
    "engine/torch/cross_barrier.py":
        "test_small_parts.py::test_cross_barrier_of_one_worker_is_the_wrapped_optimizer",
    "engine/torch/elastic.py":
        "test_small_parts.py::test_an_elastic_training_function_commits_and_resumes_from_its_state",
    "engine/torch/mpi_ops.py": HOROVOD_OF_ONE,
    "engine/torch/optimizer.py": "test_torch_plugin.py::test_api",
    "engine/torch/pinning.py":
        "test_staging.py::test_a_result_read_where_it_arrived_lands_whole_and_divided",
    "engine/torch/process_sets.py": HOROVOD_OF_ONE,
    "engine/torch/staging.py":
        "test_staging.py::test_pushes_start_in_the_order_of_the_calls_and_come_back_as_they_finish",
    "engine/torch/sync_batch_norm.py": HOROVOD_OF_ONE,
    "engine/torch/staleness.py":
        "test_small_parts.py::test_staleness_applies_the_gradient_of_s_steps_ago_and_flush_the_rest",
    "engine/trace.py":
        "test_trace.py::test_every_traced_push_has_its_sum_and_result_in_causal_order",
    "engine/worker.py": "test_engine.py::test_sum_is_exact_for_integer_valued_data",
    "errors.py":
        "test_cli.py::test_every_bpsctl_error_exits_with_its_code_and_its_message_verbatim",
    "launch/__init__.py": "test_launch.py::test_local_cluster_is_private_and_always_stopped",
    "launch/api.py": "test_launch.py::test_local_cluster_is_private_and_always_stopped",
    "launch/cgexec.py":
        "test_small_parts.py::test_cgexec_joins_the_group_then_becomes_the_command_with_the_same_pid",
    "launch/cluster.py": "test_launch.py::test_run_on_a_private_cluster_streams_prefixed_output",
    "launch/dmlc.py": "test_bpslaunch.py::"
        "test_a_key_turns_on_hmac_and_without_one_the_job_says_it_is_unauthenticated",
    "launch/emulate.py": "test_emulate.py::test_plan_names_addresses_ranks",
    "launch/hostkeys.py":
        "test_hostkeys.py::test_a_new_file_is_private_a_known_key_is_kept_and_a_changed_one_refused",
    "launch/hosts.py": "test_hosts.py::test_bad_hosts_yaml_names_file_line_and_key",
    "launch/k8s.py": "test_schedulers.py::test_manifests_validate_against_the_kubernetes_schemas",
    "launch/local.py": "test_launch.py::test_up_status_down_leaves_nothing",
    "launch/output.py": "test_launch.py::test_run_on_a_private_cluster_streams_prefixed_output",
    "launch/plan.py": "test_plan.py::test_plan_is_pure",
    "launch/pod.py": "test_schedulers.py::test_a_pod_runs_its_ranks_as_kubernetes_would_start_it",
    "launch/preflight.py": "test_small_parts.py::test_preflight_knows_each_hosts_ports_and_nic",
    "launch/processes.py": "test_launch.py::test_first_failure_stops_the_others",
    "launch/remote.py": "test_ship.py::test_the_agent_check_says_what_the_roles_cannot_import",
    "launch/report.py":
        "test_launch.py::test_status_reports_a_dead_server_and_the_workers_of_a_job",
    "launch/runloop.py": "test_runloop.py::test_all_workers_exit_zero",
    "launch/ship.py": "test_ship.py::test_the_wheel_requires_only_the_core_dependencies",
    "launch/slurm.py": "test_schedulers.py::test_per_node_counts_expand_as_slurm_writes_them",
    "launch/ssh.py":
        "test_small_parts.py::test_a_recorded_ssh_cluster_plans_a_worker_per_slot_with_its_workdir",
    "launch/state.py": "test_launch.py::test_up_status_down_leaves_nothing",
    "launch/transport.py": "test_ship.py::test_a_host_with_everything_needs_nothing",
    "launch/types.py":
        "test_hostkeys.py::test_a_cluster_recorded_before_the_setting_uses_the_state_dirs_file",
    "model.py": "test_tune.py::test_model_colocated_split_is_bytepss_optimum",
    "trace/api.py": "test_trace.py::test_bpsctl_trace_merges_and_summarises",
    "trace/cli.py": "test_trace.py::test_bpsctl_trace_refuses_what_is_not_a_trace_naming_the_file",
    "trace/plot.py": "test_small_parts.py::test_bpsctl_trace_draws_a_step_picture",
    "tune/api.py": "test_tune.py::test_space_covers_the_knobs_asked_for_and_keeps_the_rest",
    "tune/cli.py": "test_small_parts.py::test_tune_flag_mistakes_exit_2_naming_the_flag",
    "tune/model.py": "test_tune.py::test_the_model_keeps_its_documented_name",
    "tune/report.py":
        "test_bench_output.py::test_tune_table_fits_80_columns_when_the_choice_is_the_current_config",
}
PACKAGE = TESTS.parent / "bpsctl"


def _has_code(path: Path) -> bool:
    """More than a docstring (empty package markers need no test)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
               for node in body)


def test_every_module_of_bpsctl_has_a_fast_test():
    modules = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if _has_code(path)}
    missing = sorted(modules - set(FAST_TEST_OF))
    assert not missing, f"name a fast test of each in FAST_TEST_OF: {missing}"
    assert not set(FAST_TEST_OF) - modules, "FAST_TEST_OF names modules that are gone"


@pytest.mark.parametrize("module", sorted(FAST_TEST_OF))
def test_each_modules_fast_test_exists_and_is_fast(module):
    key = FAST_TEST_OF[module]
    test_module, _, name = key.partition("::")
    assert name in _test_functions(test_module), f"{module}: {key} is not a test"
    tags = TIERS.get(test_module, set()) | TIERS.get(key, set())
    assert not tags & {"slow", "gpu"}, f"{module}: {key} is not in the fast tier ({tags})"


class _Options:
    def __init__(self, markexpr: str):
        self.markexpr = markexpr

    def getoption(self, name: str, default: object = None) -> object:
        return self.markexpr if name == "markexpr" else default


class _Reporter:
    def __init__(self):
        self.lines: list[str] = []

    def write_sep(self, sep: str, title: str, **markup: object) -> None:
        self.lines.append(f"== {title}")

    def write_line(self, line: str) -> None:
        self.lines.append(line)


def _summary(markexpr: str, seconds: dict[str, float], monkeypatch) -> list[str]:
    monkeypatch.setattr(conftest, "_fast_test_seconds", seconds)
    # (this worker's own record of the slow tests it ran before: none in this summary)
    monkeypatch.setattr(conftest, "_slow_test_seconds", {})
    reporter = _Reporter()
    conftest.pytest_terminal_summary(reporter, 0, _Options(markexpr))  # type: ignore[arg-type]
    return reporter.lines


def test_a_fast_tier_run_ends_naming_its_ten_slowest_tests(monkeypatch):
    seconds = {f"tests/test_x.py::test_{i}": i / 10 for i in range(30)}
    lines = _summary(' not  slow ', seconds, monkeypatch)
    assert lines[0] == f"== the {conftest.SLOWEST_SHOWN} slowest tests of the fast tier"
    named = [line.split()[-1] for line in lines[1:]]
    assert conftest.SLOWEST_SHOWN == 10
    assert named == [f"tests/test_x.py::test_{i}" for i in range(29, 19, -1)]
    assert lines[1] == "   2.9 s  tests/test_x.py::test_29"


def test_other_runs_name_only_the_fast_tests_over_the_limit(monkeypatch):
    seconds = {"tests/test_x.py::test_quick": 0.5, "tests/test_x.py::test_long": 7.0}
    assert _summary("", seconds, monkeypatch) == [
        f"== tests outside `slow` over {conftest.FAST_LIMIT_S:g} s",
        "   7.0 s  tests/test_x.py::test_long",
        "mark them slow in tests/conftest.py (TIERS), or make them cheaper"]
    assert _summary("slow", {"tests/test_x.py::test_quick": 0.5}, monkeypatch) == []


def test_tests_are_scheduled_by_module_and_the_machines_tests_together():
    """Under ``--dist loadgroup`` a module's tests share a worker (its module-scoped cluster
    starts once), and the tests that own the whole machine all share one; the groups come from
    the node ids, so they hold whether or not pytest-xdist's id suffix arrives."""
    assert conftest.group_of_nodeid("tests/test_engine.py::test_a[case-1]") == "test_engine.py"
    assert conftest.group_of_nodeid("tests/test_engine.py::test_b") == "test_engine.py"
    machine = [key for key, tags in TIERS.items() if tags & conftest.MACHINE_TAGS]
    assert machine
    for key in machine:
        assert conftest.group_of_nodeid(f"tests/{key}") == conftest.MACHINE_GROUP, key
    assert conftest.group_of_nodeid("tests/test_x.py::test_y@somewhere") == "somewhere"
    assert conftest.group_of_nodeid("tests/test_x.py::test_y[a@b]") == "test_x.py"
    assert hasattr(conftest, "pytest_xdist_make_scheduler")

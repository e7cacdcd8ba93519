"""Shared pieces of the tests: which tests are slow and what each needs (root, a GPU, sshd,
jemalloc), a real cluster per module, jobs of worker threads, and process checks.

Several ``Worker`` objects can live in one process (each owns its own ZeroMQ context and I/O
thread), so correctness tests run their workers as threads against real server processes.
"""
from __future__ import annotations

import contextlib
import ctypes.util
import functools
import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

import bpsctl
from bpsctl.config import Config
from bpsctl.engine import Worker
from bpsctl.engine import protocol as P
from bpsctl.engine.security import Security
from bpsctl.launch import api

# Every process the tests start (pytest's workers, the command line, servers, training workers)
# inherits this. OpenBLAS starts a thread per core as NumPy loads, most of the CPU time of
# importing NumPy (and a seventh of torch's), and no test needs BLAS threads: on 2 cores, with
# many processes at once, that start-up only takes CPU from the tests. (bpsctl's servers and
# schedulers set it themselves; a user's training script keeps what its environment says.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Every Python process the tests start runs tests/lazy_dynamo/sitecustomize.py first, and this
# one runs it now: torch's optimizers import torch._dynamo, about half of a torch process's
# start, and the suite starts hundreds of them, though nothing in the tests compiles; it defers
# that import without changing what torch computes (its docstring says how).
LAZY_DYNAMO = Path(__file__).resolve().parent / "lazy_dynamo"
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != str(LAZY_DYNAMO):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(LAZY_DYNAMO), os.environ.get("PYTHONPATH")]))
_spec = importlib.util.spec_from_file_location("tests_lazy_dynamo",
                                               LAZY_DYNAMO / "sitecustomize.py")
assert _spec is not None and _spec.loader is not None
lazy_dynamo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lazy_dynamo)
lazy_dynamo.install()

# pytest rewrites the asserts of every test module in each of its processes (the controller
# and each xdist worker): 4-5 CPU-s per process for this suite. It keeps the result beside the
# module (tests/__pycache__, ignored by git) and reads it back next time, but writes it only
# where Python may write bytecode; containers and CI machines often set PYTHONDONTWRITEBYTECODE,
# and then every run of the fast tier paid the rewrite again. The tests' own cache is written
# whatever that variable says (as pytest_configure below does for bpsctl's modules); it does
# not pass to the processes the tests start.
sys.dont_write_bytecode = False

# --------------------------------------------------------------------------- tiers and needs
#
# Decided here and nowhere else. `python -m pytest -m "not slow"` is the developer loop (about
# a minute on 2 cores); the README's `python -m pytest -q` runs everything, as CI does.

#: tags of the tests, by module ("test_x.py"), by test ("test_x.py::name") or by one case of a
#: parametrized test ("test_x.py::name[id]"); a test takes the tags of every key naming it.
#: ``slow``, ``root`` and ``gpu`` become markers (declared in pyproject.toml); every other tag,
#: and ``root`` and ``gpu``, is a need (NEEDS): without it the test skips, saying why. ``slow``
#: is anything over about 5 s on a busy 2-core machine, setup included (a module-scoped
#: fixture's cost falls on the module's first test), and the kinds that take minutes.
TIERS: dict[str, set[str]] = {
    # a private cluster and two spawned workers stopped by a Ctrl-C (1-3 s)
    "test_load.py::test_a_ctrl_c_while_the_workers_start_stops_the_load_and_every_worker":
        {"slow"},
    # 8 workers x 4 servers for 400 steps: about a minute
    "test_load.py::test_8_workers_4_servers_400_steps_exact_sums_and_flat_memory":
        {"slow", "cores"},
    # kill -9 / cut links on emulated clusters (2 runs of each fault): about 60 s
    "test_fault_injection.py": {"slow", "root"},
    # engine faults: processes killed or silent, deadlines running out (2-4 s each, 25 s in all)
    "test_engine_faults.py": {"slow"},
    "test_bench_comm.py::test_a_lost_server_fails_the_bench_and_its_logs_are_kept": {"slow"},
    # bench comm --op against Horovod: two jobs of 2 workers through the CLI (every collective
    # checked and timed), on the embedded default and on 2 emulated hosts
    "test_bench_comm.py::test_every_collective_against_horovod_on_the_embedded_default": {"slow"},
    "test_bench_comm.py::test_collectives_against_horovod_on_two_emulated_hosts":
        {"slow", "root"},
    # a throwaway virtualenv with the newest allowed dependencies, and a smoke subset in it
    "test_fresh_install.py::test_the_newest_allowed_dependencies_pass_a_smoke_subset": {"slow"},
    # hypothesis against live sockets: 2-5 s each
    "test_fuzz_wire.py": {"slow"},
    # two torch processes side by side, one of them importing torch._dynamo: 3-4 s
    "test_lazy_dynamo.py": {"slow"},
    # allocators and idle release, each waiting for a quiet spell: 2-5 s each
    "test_memory.py": {"slow"},
    "test_memory.py::test_a_server_runs_on_jemalloc_unless_told_to_use_glibc": {"jemalloc"},
    "test_memory.py::test_release_gives_back_what_a_burst_freed_and_keeps_what_is_held[jemalloc]":
        {"jemalloc"},
    # a worker killed mid-job under --min-workers: 6 s each
    "test_resilience.py::test_a_killed_worker_leaves_the_job_going_with_averages_over_the_rest":
        {"slow"},
    "test_resilience.py::test_a_killed_worker_leaves_a_gathers_rounds_of_zeros_going": {"slow"},
    "test_resilience.py::test_torch_training_goes_on_without_a_lost_worker_and_says_so":
        {"slow"},
    # Horovod-style elastic scripts with an ElasticSampler on 2 and 3 workers, and one with a
    # worker killed mid-epoch under --min-workers or restarted: 10-20 s each
    "test_elastic_sampler.py::"
    "test_a_horovod_elastic_script_keeps_every_rank_s_loader_on_the_state_s_sampler": {"slow"},
    "test_elastic_sampler.py::test_a_lost_worker_s_samples_are_each_processed_exactly_once":
        {"slow"},
    "test_elastic_sampler.py::"
    "test_a_restarted_worker_rejoins_at_a_reset_and_every_index_is_still_processed_once":
        {"slow"},
    # ... and one attached mid-epoch with `bpsctl run --attach`: 15-40 s
    "test_elastic_sampler.py::test_a_worker_attached_mid_epoch_takes_a_share_of_what_is_left":
        {"slow"},
    # faults the job survives on an emulated 4x4 cluster (1 run of each): about 3 minutes
    "test_fault_recovery.py": {"slow", "root"},
    # a worker killed and restarted under `bpsctl run --max-restarts`, or attached to a running
    # job with `bpsctl run --attach`: 10-25 s each
    "test_rejoin.py": {"slow"},
    # emulated clusters (network namespaces): 1-10 s each
    "test_resilience.py::test_a_link_cut_between_a_worker_and_a_server_heals_and_nothing_moves":
        {"slow", "root"},
    "test_trace.py::test_a_slow_host_is_named_and_the_nic_tracks_count_the_bytes_sent":
        {"slow", "root"},
    "test_emulated_cluster.py": {"slow", "root"},
    # the mixed layout on 4 emulated worker hosts and 2 CPU hosts: a job and bench comm (about
    # 7 s)
    "test_layout.py::"
    "test_an_emulated_4_plus_2_cluster_sums_exactly_and_each_server_carries_its_share":
        {"slow", "root"},
    # two workers per emulated host: a 4-rank torch job through the intra-node stage (about
    # 9 s); bench comm with --workers-per-host 2 (about 5 s)
    "test_workers_per_host.py::"
    "test_two_ranks_per_emulated_host_sum_exactly_through_the_shared_memory_stage":
        {"slow", "root"},
    "test_workers_per_host.py::test_bench_comm_runs_n_times_k_workers_judged_per_host":
        {"slow", "root"},
    "test_stragglers.py::test_a_cpu_straggler_host_runs_its_processes_in_a_throttled_cgroup":
        {"slow", "root"},
    "test_stragglers.py::test_every_emulated_worker_host_runs_in_a_cgroup_of_its_cpu":
        {"slow", "root"},
    # 2 emulated worker hosts in cgroups of one CPU each, a small profile: 5-10 s
    "test_replay.py::test_a_replay_with_a_target_cpu_runs_its_worker_hosts_at_the_dilated_share":
        {"slow", "root"},
    # three systems, each a 2-worker training job to a target accuracy: about 30 s
    "test_stragglers.py::test_every_system_reaches_its_target_accuracy": {"slow"},
    # three 2-worker training jobs of 200 steps (sync, onebit, onebit:noef): about 10-25 s
    "test_compression.py::test_bench_convergence_shows_what_error_feedback_is_for": {"slow"},
    # a 1-worker training job to the target: about 5 s
    "test_compression.py::test_bench_convergence_without_steps_stops_at_the_target": {"slow"},
    # Horovod's collectives: one job each of 1, 2 and 3 workers running every check (about
    # 20 s each on 2 busy cores)
    "test_horovod_api.py::test_horovod_collectives": {"slow"},
    # a worker vanishing under a Horovod collective: 2 s of missed heartbeats, about 6 s
    "test_horovod_api.py::test_a_lost_peer_fails_the_collective_with_horovod_internal_error":
        {"slow"},
    # Horovod's join with uneven data: a 3-rank torch job (its two tests share it), a 2-rank one
    # held past a 2 s op timeout, a 2-rank MXNet job (about 5-12 s each); the engine's join on
    # worker threads stays fast
    "test_horovod_join.py::test_uneven_data_with_join_on_three_ranks": {"slow"},
    "test_horovod_join.py::"
    "test_a_gather_or_broadcast_while_a_rank_has_joined_raises_horovods_error": {"slow"},
    "test_horovod_join.py::"
    "test_a_rank_that_neither_joins_nor_makes_progress_fails_the_join_at_the_op_timeout":
        {"slow"},
    "test_horovod_join.py::test_mxnet_join_on_two_ranks": {"slow"},
    "test_horovod_join.py::"
    "test_through_the_intra_node_stage_a_collective_after_a_join_says_how_to_go_on": {"slow"},
    "test_horovod_join.py::test_a_worker_lost_during_a_join_counts_as_joined": {"slow"},
    # Horovod's synthetic benchmark on 2 workers (where its examples are given): about 13 s
    "test_horovod_api.py::test_horovods_synthetic_benchmark_runs_with_only_its_import_changed":
        {"slow"},
    # Horovod's three elastic PyTorch examples on 2 and 3 workers (where its examples are
    # given): a job each, 6-10 s (about 50 s for the six on 2 busy cores)
    "test_horovod_elastic_examples.py": {"slow"},
    # a Horovod-style MNIST script, 2 workers for 3 epochs; and on 2 emulated hosts
    "test_horovod_api.py::test_an_mnist_style_horovod_script_trains_with_only_its_import_changed":
        {"slow"},
    "test_horovod_api.py::test_an_mnist_style_horovod_script_trains_on_two_emulated_hosts":
        {"slow", "root"},
    "test_chaos.py::test_a_partition_cuts_a_host_off_both_ways_and_heals": {"slow", "root"},
    "test_chaos.py::test_a_connection_cut_for_4_s_carries_data_again_within_a_second_and_a_half_of_healing":
        {"slow", "root"},
    "test_chaos.py::test_a_pause_stops_every_process_of_the_host_until_it_ends_and_a_kill_ends_them":
        {"slow", "root"},
    "test_chaos.py::test_a_lossy_link_and_a_collapsed_one_are_shaped_then_restored":
        {"slow", "root"},
    "test_chaos.py::test_a_full_disk_is_every_byte_of_its_file_system_until_undone": {"root"},
    "test_chaos.py::test_ctrl_c_ends_a_sweep_of_seeds_and_leaves_nothing": {"slow", "root"},
    "test_chaos.py::test_bpsctl_chaos_trains_through_a_seeded_schedule_and_checks_it":
        {"slow", "root"},
    "test_emulate.py::test_create_reach_destroy": {"slow", "root"},
    "test_emulate.py::test_teardown_on_keyboard_interrupt": {"slow", "root"},
    "test_emulate.py::test_leftovers_of_a_crashed_run_are_found_and_removed": {"slow", "root"},
    "test_emulate.py::test_shaped_nics_full_duplex_fair_and_capped": {"slow", "root"},
    "test_emulate.py::test_tcp_hands_the_shaped_nic_segments_over_64_kib": {"slow", "root"},
    "test_emulate.py::test_small_data_packets_stay_in_their_peers_class_and_only_pure_acks_go_first":
        {"slow", "root"},
    "test_emulate.py::test_failed_create_removes_what_it_built": {"slow", "root"},
    "test_tune.py::test_a_small_tuning_run_on_emulated_hosts": {"slow", "root"},
    "test_tune.py::test_tuning_for_a_replayed_gpu_cluster_scores_in_the_target_nics_time": {
        "slow", "root"},
    "test_tune.py::test_run_and_up_use_the_tuned_file_unless_overridden": {"slow"},
    # SSH: a real sshd per emulated host
    "test_cli.py::test_a_host_that_does_not_speak_ssh_fails_preflight_in_one_message_without_"
    "tracebacks": {"slow", "ssh extra"},
    "test_cli.py::test_ctrl_c_on_a_benchmark_stops_it_as_an_interruption_not_a_crash":
        {"slow"},
    "test_cli.py::test_ctrl_c_in_a_terminal_stops_bench_load_with_one_line_and_no_traceback":
        {"slow"},
    "test_ssh_cluster.py": {"slow", "root", "sshd", "ssh extra"},
    "test_bench_ssh.py": {"slow", "root", "sshd", "ssh extra"},
    # a real Slurm (slurmctld + one slurmd per emulated host): 5-15 s each; the bench jobs
    # 20-55 s (comm against allreduce) and 80-140 s (ResNet50 against Horovod and DDP)
    "test_slurm.py": {"slow", "root", "slurm"},
    # the H200's ResNet50 replayed x25 against DDP and Horovod on emulated hosts: 40-50 s
    "test_replay.py::test_a_dilated_replay_against_the_baselines_on_emulated_hosts":
        {"slow", "root"},
    # a sweep of 1 and 2 workers on the embedded default, a small profile: 10-20 s
    "test_replay.py::test_a_replay_sweep_runs_every_system_at_each_worker_count": {"slow"},
    # the same profile with --cross-barrier, 2 workers on the embedded default: 5-10 s
    "test_replay.py::test_a_replay_trains_bpsctl_with_the_cross_barrier": {"slow"},
    "test_replay.py::test_recording_on_a_gpu_times_every_parameter_with_cuda_events":
        {"gpu", "slow"},
    # ResNet50 training against DDP and Horovod: 20-30 s each
    "test_bench_train.py::test_train_bench_on_emulated_hosts_against_the_baselines":
        {"slow", "root"},
    "test_bench_train.py::test_rounds_rotate_the_order_and_pair_the_ratios": {"slow"},
    "test_bench_train.py::test_async_training_reports_the_sum_of_each_workers_rate": {"slow"},
    # full training on 4 workers (the module's fixture trains every variant: about 12 s)
    "test_torch_training.py": {"slow"},
    # CrossBarrier on 2 workers (quiet machine / loaded): one job trains every variant, 7-25 s;
    # a lost peer, 10 s; a worker restarted under --max-restarts, 20-30 s; bench resnet50
    # --cross-barrier, 11-45 s
    "test_cross_barrier.py": {"slow"},
    # the plugins on more than 2 workers (5-7 s each launch under load), and MXNet's Gluon
    # training on 2 (3 s); the torch API checks on 2 workers and MXNet's one-worker
    # asynchronous SGD stay in the fast tier
    "test_torch_plugin.py::test_intranode_stage_gives_exact_sums": {"slow"},
    "test_mxnet_plugin.py::test_api_on_three_workers": {"slow"},
    "test_mxnet_plugin.py::test_gluon_training_on_n_workers_matches_one_process_on_the_whole_batch[2]":
        {"slow"},
    "test_mxnet_plugin.py::test_gluon_training_on_n_workers_matches_one_process_on_the_whole_batch[3]":
        {"slow"},
    "test_mxnet_plugin.py::test_gluon_training_on_n_workers_matches_one_process_on_the_whole_batch[4]":
        {"slow"},
    # the intra-node stage on shared memory: a job of real workers each (5-10 s); the 2-worker
    # job on one host and the unit tests of the arena stay in the fast tier
    # over 3 s each on an idle machine: two worker processes summing through the host's arena,
    # and the per-tensor benchmark's 161 tensors through a cluster (their pure parts stay fast)
    "test_small_parts.py::test_the_per_tensor_overhead_benchmark_checks_its_sums_and_reports":
        {"slow"},
    "test_shm_local.py::test_sums_and_averages_are_exact[1-local]": {"slow"},
    "test_shm_local.py::test_sums_and_averages_are_exact[2-gloo]": {"slow"},
    "test_shm_local.py::test_sums_and_averages_are_exact[3-servers]": {"slow"},
    "test_shm_local.py::test_sums_and_averages_are_exact[4-local]": {"slow"},
    "test_shm_local.py::test_tensors_larger_than_the_arena_bound_sum_exactly_in_pieces": {"slow"},
    "test_shm_local.py::test_a_killed_local_worker_is_named_within_10_s_and_its_shared_memory_is_gone":
        {"slow"},
    # shared memory between a worker and a server: a small tmpfs mounted, another network
    # namespace; processes killed mid-job (8-10 s each)
    "test_shm_server.py::test_a_dev_shm_too_small_is_an_error_naming_the_bound_and_the_knob":
        {"root"},
    "test_shm_server.py::test_a_process_in_another_network_namespace_is_on_another_host":
        {"root"},
    "test_shm_server.py::test_by_default_a_process_takes_what_the_model_needs_while_a_quarter_stays_free[8m]":
        {"root"},
    "test_shm_server.py::test_a_killed_worker_is_named_within_10_s_and_down_leaves_no_segment":
        {"slow"},
    "test_shm_server.py::test_a_killed_server_leaves_its_sum_buffers_until_down": {"slow"},
    "test_shm_server.py::test_emulated_hosts_keep_their_traffic_on_the_shaped_nics":
        {"slow", "root"},
    # CUDA; and a fresh interpreter importing torch, then a 2-worker job, for the CPU-only case
    "test_torch_gpu.py::test_cpu_users_touch_no_cuda": {"slow"},
    # 3-7 s each on the idle 2-core machine (more while other tests run beside them): torch
    # workers in subprocesses, a training job through the CLI, or a killed scheduler's restart
    "test_sched_restart.py": {"slow"},
    "test_torch_plugin.py::test_a_big_gradient_is_not_page_faulted_in_anew_every_step": {"slow"},
    "test_staleness.py::test_updates_are_the_averages_of_s_steps_ago_and_a_fast_worker_leads_by_at_most_s":
        {"slow"},
    "test_trace.py::test_the_torch_optimizer_waiting_for_its_gradients_is_on_the_timeline":
        {"slow"},
    "test_trace.py::test_bench_trace_writes_bpsctls_timeline_and_not_the_baselines": {"slow"},
    # one 3-4 s job of many workers; the trace's causal order has its fast test beside it
    "test_trace.py::test_one_big_tensor_of_many_workers_completes_in_the_order_it_is_pushed":
        {"slow"},
    "test_cli.py::test_up_status_down": {"slow"},
    "test_async.py::test_torch_training_with_server_held_parameters": {"slow"},
    "test_tune.py::test_commands_refuse_a_bad_file_with_exit_2_but_down_still_works": {"slow"},
    "test_tune.py::test_bench_reads_the_file_and_its_flags_win": {"slow"},
    # one-worker torch jobs through `bpsctl run`, alone and forced through the servers
    "test_paths.py::test_one_torch_worker_trains_as_plain_torch_unless_forced": {"slow"},
    # two bpsctl workers and two gloo processes through the CLI (5-9 s); the allreduce program
    # itself has a fast test in test_small_parts.py
    "test_bench_comm.py::test_comm_bench_against_allreduce_shows_a_table_and_what_it_means":
        {"slow"},
    # a Gluon training job of worker processes each (3-4 s); the plugin's API and its
    # one-worker asynchronous SGD stay fast
    "test_mxnet_plugin.py::test_asynchronous_gluon_training_with_server_held_parameters":
        {"slow"},
    "test_mxnet_plugin.py::test_a_traced_trainer_marks_its_steps_and_its_wait_for_the_gradients":
        {"slow"},
    # a Horovod-MXNet script on 2 workers (about 3 s idle), and a worker vanishing under its
    # allreduce (2 s of missed heartbeats, about 5 s); on 1 worker the script stays fast
    "test_horovod_mxnet.py::test_a_horovod_mxnet_script_on_two_workers": {"slow"},
    "test_horovod_mxnet.py::test_a_lost_peer_fails_the_collective_with_horovod_internal_error":
        {"slow"},
    # process sets on 3 workers: a torch job through the intra-node stage and one through the
    # servers, each running every check (5-10 s each), and an MXNet job; the engine's scoped
    # sums on worker threads stay fast
    "test_process_sets.py::test_process_sets_of_the_torch_plugin": {"slow"},
    # a worker of one of two process sets killed under `--min-workers` (1 s of missed
    # heartbeats; a 3-worker torch job, about 10 s)
    "test_process_sets.py::test_a_lost_worker_leaves_only_its_own_sets_short": {"slow"},
    "test_horovod_mxnet.py::test_process_sets_on_three_workers": {"slow"},
    # a job of two workers refused at init (3-4 s); the stage's sums stay fast
    "test_shm_local.py::test_an_arena_larger_than_dev_shm_is_refused_at_init_naming_the_knob":
        {"slow"},
    # trains a model per compressor (4-5 s); the compressors' own tests stay fast
    "test_compression.py::test_compressors_with_error_feedback_train_close_to_uncompressed":
        {"slow"},
    # the README's hello world: a 2-worker training job through the CLI, about 8 s
    "test_examples.py": {"slow"},
    # BytePS's recipe through bpslaunch: 4 roles training the hello world, beside `bpsctl run`'s
    # (about 16 s); two workers with one DMLC_WORKER_ID, ended by the start deadline (about 10 s)
    "test_bpslaunch.py::test_bytepss_recipe_trains_the_example_in_any_start_order_as_bpsctl_run_does":
        {"slow"},
    "test_bpslaunch.py::test_two_workers_with_one_id_get_a_named_error_and_nothing_hangs": {"slow"},
    "test_bpslaunch.py::test_a_scheduler_and_a_server_no_worker_comes_to_end_naming_dmlc_num_worker":
        {"slow"},
    "test_bpslaunch.py::test_bytepss_recipe_trains_a_byteps_mxnet_script_as_bpsctl_run_does":
        {"slow"},
    "test_bpslaunch.py::test_k8s_render_dmlc_pods_run_the_job_as_the_kubelet_would_start_them":
        {"slow"},
    "test_bpslaunch.py::test_bytepss_recipe_on_emulated_hosts_each_role_in_its_own_namespace":
        {"slow", "root"},
    "test_bpslaunch.py::test_workers_started_without_bpslaunch_join_as_bytepss_own_tests_start_them":
        {"slow"},
    "test_bpslaunch.py::test_two_machines_of_two_gpus_each_train_as_four_workers_of_bpsctl_run":
        {"slow"},
    # three bpslaunch processes refused by their deadlines: 1.5-3.5 s on busy cores
    "test_bpslaunch.py::test_bad_variables_and_an_unreachable_root_end_each_role_by_its_deadline":
        {"slow"},
    # the fast tier kept under a minute on 2 busy cores: what follows ran 2-8 s each there and
    # has a cheaper sibling (another case, or a test of the same code) left in the fast tier.
    # setuptools builds the wheel in a subprocess (about 7 s); the wheel's requirements stay fast
    "test_ship.py::test_the_packed_wheel_is_the_one_setuptools_builds": {"slow"},
    # pip installs the repacked wheel (about 3 s each); mdurl's case stays fast
    "test_ship.py::test_a_repacked_wheel_installs_as_the_original[psutil]": {"slow"},
    # a cluster up, a job crashed, `down` (about 6 s); the arena's own tests stay fast
    "test_shm_local.py::test_down_removes_what_a_crashed_job_of_its_cluster_left_and_nothing_else":
        {"slow"},
    # a cluster and two hand-started servers, three workers, two placements (about 5 s)
    "test_layout.py::test_the_scheduler_places_by_the_servers_shares_the_same_for_every_worker":
        {"slow"},
    # 100 MB through real servers (about 5 s); the exact sums of every dtype stay fast
    "test_engine.py::test_a_100mb_tensor_averaged_over_two_workers": {"slow"},
    # a second SGD variant on the servers (2-3 s); momentum's case stays fast
    "test_async.py::test_the_server_steps_as_torch_sgd_does[nesterov]": {"slow"},
    # `bpsctl up --security none` and a stranger's job (about 4 s); the refusals stay fast
    "test_security.py::test_none_lets_anyone_in_and_up_warns_about_it": {"slow"},
    # the module's cluster with a spare (about 4 s to start) and a server killed under it; the
    # spare-count checks stay fast
    "test_spare_servers.py::"
    "test_a_spare_holds_nothing_until_it_takes_over_a_killed_servers_partitions": {"slow"},
    "test_spare_servers.py::"
    "test_a_server_lost_between_jobs_is_replaced_by_the_spare_for_the_next_job": {"slow"},
    # a server killed while its memory is lent (about 3 s); lending on one worker stays fast
    "test_lend.py::test_filled_slots_survive_a_lost_server_whose_memory_is_unpinned": {"slow"},
    "test_lend.py::test_slots_the_caller_fills_and_sums_it_reads_in_place_are_exact[2-1]":
        {"slow"},
    "test_lend.py::test_slots_the_caller_fills_and_sums_it_reads_in_place_are_exact[2-2]":
        {"slow"},
    # waiting out a server's heartbeat deadline, a worker killed by a signal (about 3 s each);
    # a dead server's report and the first failure stopping the others stay fast
    "test_launch.py::test_status_reports_a_silent_server_lost": {"slow"},
    "test_launch.py::test_a_worker_killed_by_a_signal_exits_128_plus_n": {"slow"},
    # one case of each stays fast: 8 ranks in pods, the 8x4 manifests, more bad flags and
    # values (a CLI process each, about 2 s on a busy machine)
    "test_schedulers.py::test_hosts_per_node_runs_that_many_ranks_in_each_worker_pod[8-4]":
        {"slow"},
    "test_schedulers.py::test_manifests_validate_against_the_kubernetes_schemas[8-4]": {"slow"},
    "test_schedulers.py::test_a_bad_flag_exits_2_before_anything_is_rendered"
    "[args1---servers: expected a whole number of at least 1]": {"slow"},
    "test_schedulers.py::test_a_bad_flag_exits_2_before_anything_is_rendered"
    "[args2---worker-cpu: expected]": {"slow"},
    "test_schedulers.py::test_a_bad_flag_exits_2_before_anything_is_rendered"
    "[args3---name: expected]": {"slow"},
    "test_schedulers.py::test_a_bad_flag_exits_2_before_anything_is_rendered"
    "[args4---worker-node: expected]": {"slow"},
    "test_schedulers.py::test_a_bad_hosts_per_node_exits_2_before_anything_is_rendered[-1]":
        {"slow"},
    "test_schedulers.py::test_a_bad_hosts_per_node_exits_2_before_anything_is_rendered[-4]":
        {"slow"},
    "test_spare_servers.py::test_a_spare_count_bpsctl_cannot_start_exits_2_naming_the_flag"
    "[args2--message2]": {"slow"},
    "test_spare_servers.py::test_a_spare_count_bpsctl_cannot_start_exits_2_naming_the_flag"
    "[args3--message3]": {"slow"},
    "test_compression.py::"
    "test_a_compressed_partition_moved_off_a_lost_server_starts_its_error_feedback_empty"
    "[randomk:0.1]": {"slow"},
    "test_bench_train.py::"
    "test_device_cuda_without_cuda_is_a_usage_error_naming_what_is_missing[resnet50]": {"slow"},
    "test_workers_per_host.py::test_workers_per_host_without_emulated_hosts_exits_2_saying_what_to_do"
    "[args1-only with --emulate]": {"slow"},
    "test_workers_per_host.py::test_workers_per_host_without_emulated_hosts_exits_2_saying_what_to_do"
    "[args2-only with --emulate]": {"slow"},
    # VGG16 built (528 MiB of parameters, about 3 s); ResNet50's cases stay fast
    "test_small_parts.py::test_the_benchs_shapes_are_its_models_and_fuse_into_the_same_pushes"
    "[vgg16-1000]": {"slow"},
    # more cluster shapes of two-way compression (a job each, 2-3 s); 1x1 and 2x3 stay fast
    "test_compression.py::test_two_way_compression_through_real_servers[3-2]": {"slow"},
    "test_compression.py::test_two_way_compression_through_real_servers[4-4]": {"slow"},
    "test_compression.py::test_two_way_compression_through_real_servers[4-1]": {"slow"},
    "test_compression.py::test_two_way_compression_through_real_servers[1-4]": {"slow"},
    # 4000 rounds of stochastic rounding each (about 2 s); two levels' case stays fast
    "test_compression.py::test_dithering_rounds_stochastically_without_bias[dithering:3:natural]":
        {"slow"},
    "test_compression.py::test_dithering_rounds_stochastically_without_bias[dithering:4:l2]":
        {"slow"},
    # a job through the CLI, failed or interrupted (3-4 s each); test_launch's first failure and
    # test_cli's relayed output stay fast
    "test_cli.py::test_run_exits_with_the_first_failure_and_stops_the_others": {"slow"},
    "test_cli.py::test_ctrl_c_stops_every_worker": {"slow"},
    # a server killed and replaced mid-job (about 5 s); a lost server's push counted once stays
    "test_resilience.py::test_a_killed_server_is_replaced_and_every_sum_stays_exact": {"slow"},
    # it waits out a heartbeat timeout (1 s) on a cluster of its own
    "test_resilience.py::test_a_lost_server_that_registers_again_on_a_new_connection_is_fenced":
        {"slow"},
    "test_resilience.py::test_a_paused_server_declared_lost_is_fenced_when_it_comes_back":
        {"slow"},
    # a server killed between a broadcast's pushes (PUSH_ZERO pushed again): a private cluster
    "test_resilience.py::test_a_push_of_zeros_is_pushed_again_to_the_server_that_takes_over":
        {"slow"},
    "test_staleness.py::test_bad_staleness_and_combinations_exit_2_naming_the_flags[async]":
        {"slow"},
    "test_staleness.py::test_bad_staleness_and_combinations_exit_2_naming_the_flags[backup]":
        {"slow"},
    "test_staleness.py::test_bad_staleness_and_combinations_exit_2_naming_the_flags[restarts]":
        {"slow"},
    # a cluster started and stopped each (about 1 s idle); the module's other launches
    # (up/status/down, a stale state file, a private cluster, the first failure) stay fast
    "test_launch.py::test_logs_roles": {"slow"},
    # a 3-worker torch job (about 5 s); the engine's own test of `want` stays fast
    "test_horovod_api.py::test_an_alltoall_pulls_the_rows_sent_to_it_and_keeps_its_own_at_home":
        {"slow"},
    "test_launch.py::test_up_refuses_a_second_cluster": {"slow"},
    "test_launch.py::test_logs_of_the_last_cluster_stay_readable_after_a_failed_up": {"slow"},
    "test_launch.py::test_up_replaces_a_stale_state_file": {"slow"},
    # one worker's training against MXNet's own SGD (about 3 s); the module's pure and
    # synchronous cases stay fast
    "test_mxnet_plugin.py::test_asynchronous_sgd_of_one_worker_is_mxnets_own_sgd": {"slow"},
    # a `run` of 2 workers (about 2 s); launch's own streaming test stays fast
    "test_cli.py::test_run_prefixes_each_ranks_output": {"slow"},
    # two `run`s of 2 workers, one on a terminal (about 3.5 s)
    "test_cli.py::test_run_says_what_it_starts_on_a_terminal_until_the_workers_speak": {"slow"},
    # a bench process each (about 2 s idle); the design keys' and bad flags' cases stay fast
    "test_bench_comm.py::test_comm_bench_json_to_stdout_is_only_json": {"slow"},
    "test_bench_train.py::"
    "test_device_cuda_without_cuda_is_a_usage_error_naming_what_is_missing[comm]": {"slow"},
    "test_bench_train.py::test_models_have_torchvisions_parameter_shapes[vgg16-138357544-32]":
        {"slow"},
    # more kinds of unreadable trace (about 1 s each); the missing trace's case stays fast
    "test_trace.py::test_bpsctl_trace_refuses_what_is_not_a_trace_naming_the_file"
    "[truncated-not JSON, or cut short]": {"slow"},
    "test_trace.py::test_bpsctl_trace_refuses_what_is_not_a_trace_naming_the_file"
    "[version-written by bpsctl 0.0.1]": {"slow"},
    "test_trace.py::test_bpsctl_trace_refuses_what_is_not_a_trace_naming_the_file"
    "[other-not a bpsctl trace]": {"slow"},
    # CUDA: every job of these takes 8-50 s on one H200 (worker processes, CUDA start-up),
    # so they are slow as well, and a GPU machine's fast tier stays fast
    "test_torch_gpu.py::test_single_rank_cuda_push_pull": {"gpu", "slow"},
    "test_torch_gpu.py::test_gathers_of_cuda_tensors_keep_each_ranks_own_rows": {"gpu", "slow"},
    "test_torch_gpu.py::test_cupy_arrays_through_the_engine_sum_as_numpy_ones": {"gpu", "slow"},
    "test_torch_gpu.py::test_two_workers_on_one_gpu_stage_through_host_memory_and_say_so":
        {"gpu", "slow"},
    "test_torch_gpu.py::test_bench_on_a_gpu_reports_the_device_and_a_plain_row": {"gpu", "slow"},
    "test_torch_gpu.py::test_a_staged_worker_page_locks_its_shared_memory_and_lets_go_at_shutdown":
        {"gpu", "slow"},
    "test_torch_gpu.py::test_a_cuda_model_trained_through_the_host_staging_matches_the_cpu":
        {"gpu", "slow"},
    "test_torch_gpu.py::test_cuda_sums_are_exact_on_every_path": {"gpu", "2 gpus", "slow"},
    "test_torch_gpu.py::test_a_one_host_gpu_job_sends_nothing_to_the_servers_and_trains_as_ddp":
        {"gpu", "2 gpus", "slow"},
    "test_torch_gpu.py::test_distributed_optimizer_on_a_cuda_model_matches_the_cpu":
        {"gpu", "2 gpus", "slow"},
}
MARKERS = ("slow", "root", "gpu")

IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
SSHD = Path("/usr/sbin/sshd")


def _missing_root() -> str | None:
    if os.geteuid() == 0:
        return None
    return "needs root (network namespaces): run the tests as root, as CI does"


def _missing_sshd() -> str | None:
    if SSHD.exists() and shutil.which("ssh-keygen") is not None:
        return None
    return "sshd is not installed: apt-get update && apt-get install -y openssh-server"


def _missing_ssh_extra() -> str | None:
    try:
        import fabric  # noqa: F401
        import yaml  # noqa: F401
    except ImportError:
        return "the [ssh] extra is not installed: pip install -e '.[ssh]'"
    return None


def _missing_slurm() -> str | None:
    from slurm_cluster import missing_slurm
    return missing_slurm()


def _missing_jemalloc() -> str | None:
    if ctypes.util.find_library("jemalloc") is not None:
        return None
    return "libjemalloc.so.2 is not installed (apt-get install libjemalloc2)"


def _gpus() -> int:
    torch = sys.modules.get("torch")        # the GPU tests' module imported it, if it could
    if torch is None or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def _missing_gpu() -> str | None:
    if _gpus() > 0:
        return None
    return "torch.cuda.is_available() is False: no CUDA device (or a CPU-only torch)"


def _missing_two_gpus() -> str | None:
    if _gpus() >= 2:
        return None
    return ("the NCCL intra-node stage needs one GPU per local rank (NCCL refuses two ranks on "
            f"one device): 2 local ranks need 2 GPUs, {_gpus()} visible")


#: each need: why a test that has it skips here (None: this machine has it); checked in order
NEEDS: dict[str, Callable[[], str | None]] = {
    "root": _missing_root, "sshd": _missing_sshd, "ssh extra": _missing_ssh_extra,
    "jemalloc": _missing_jemalloc, "gpu": _missing_gpu, "2 gpus": _missing_two_gpus,
    "slurm": _missing_slurm,
}
#: needs that CI provides (.ci/run installs libjemalloc2 and Slurm): under CI a test skipped
#: for one fails
PROVIDED_IN_CI = {"jemalloc", "slurm"}


def tags(item: pytest.Item) -> set[str]:
    """The TIERS tags of a collected test."""
    module = item.path.name
    name = item.name
    keys = (module, f"{module}::{getattr(item, 'originalname', name)}", f"{module}::{name}")
    return set().union(*(TIERS.get(key, set()) for key in keys))


def tags_of_nodeid(nodeid: str) -> set[str]:
    """The TIERS tags of the test a node id (``tests/test_x.py::name[case]``) names: what
    :func:`tags` gives its item, for the pytest-xdist controller, which has ids, not items."""
    path, _, name = nodeid.partition("::")
    module = Path(path).name
    keys = (module, f"{module}::{name.split('[')[0]}", f"{module}::{name}")
    return set().union(*(TIERS.get(key, set()) for key in keys))


@functools.cache
def missing(need: str) -> str | None:
    return NEEDS[need]()


#: tags of the tests that own something of the whole machine (network namespaces, a mount,
#: sshd and Slurm daemons, their fixed ports): under pytest-xdist they all run on one worker,
#: one after another (``MACHINE_GROUP``), while the others run beside them. (Two such groups
#: side by side took longer on 2 cores, not less: the emulated hosts' CPU is the machine's.)
#: ``cores``: a test that loads every core for a minute or more (the soak of 12 processes): run
#: among them too, so that it never starts last and holds the run while the other worker idles
MACHINE_TAGS = {"root", "sshd", "slurm", "cores"}
MACHINE_GROUP = "machine"


def xdist_group(item_tags: set[str], module: str) -> str:
    """The pytest-xdist group of a test (``--dist loadgroup`` runs a group on one worker): the
    machine's for tests of :data:`MACHINE_TAGS`, else its module's, so that a module-scoped
    cluster is started once."""
    return MACHINE_GROUP if item_tags & MACHINE_TAGS else module


def group_of_nodeid(nodeid: str) -> str:
    """The group :func:`xdist_group` gives the test of ``nodeid``; a ``@group`` suffix (what
    pytest-xdist adds to the ids of tests marked ``xdist_group``) is taken as it is."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[1]
    return xdist_group(tags_of_nodeid(nodeid), Path(nodeid.partition("::")[0]).name)


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile bpsctl once, in the controlling process, before any test starts one.

    The tests start well over a thousand Python processes (CLI calls, servers, workers), and an
    editable install leaves bpsctl's modules uncompiled. Where ``PYTHONDONTWRITEBYTECODE`` is
    set (containers and CI machines often set it) no process writes the cache either, so every
    one of them compiled the modules it imports again, about 0.15 CPU-s per CLI call.
    ``compileall`` writes the cache whatever that variable says."""
    if hasattr(config, "workerinput"):          # a pytest-xdist worker: the controller did it
        return
    import compileall
    compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "bpsctl"), quiet=1)


#: what a test is expected to take on a busy 2-core machine, setup included, by tier (a whole
#: run's time in each tier over its count of tests; a test of LONG_TESTS apart): only the
#: order the groups start in depends on it
EXPECTED_TEST_S = {"fast": 0.06, "slow": 4.0, "long": 25.0}

#: the tests outside the machine's group that take 15-40 s on the busy 2-core machine (keys as
#: in TIERS): a module of one or two of them is short by count but must not start last
LONG_TESTS = {
    "test_fresh_install.py::test_the_newest_allowed_dependencies_pass_a_smoke_subset",
    "test_bench_train.py::test_rounds_rotate_the_order_and_pair_the_ratios",
    "test_bench_train.py::test_async_training_reports_the_sum_of_each_workers_rate",
    "test_stragglers.py::test_every_system_reaches_its_target_accuracy",
    "test_bpslaunch.py::test_two_machines_of_two_gpus_each_train_as_four_workers_of_bpsctl_run",
    "test_bpslaunch.py::test_bytepss_recipe_trains_the_example_in_any_start_order_as_bpsctl_run_does",
    "test_bench_comm.py::test_every_collective_against_horovod_on_the_embedded_default",
    "test_cross_barrier.py::test_a_restarted_worker_rejoins_a_cross_barrier_job_bitwise_equal",
    "test_cross_barrier.py::test_the_training_bench_runs_bpsctl_with_cross_barrier",
    "test_trace.py::test_the_torch_optimizer_waiting_for_its_gradients_is_on_the_timeline",
    "test_elastic_sampler.py::test_a_lost_worker_s_samples_are_each_processed_exactly_once",
    "test_compression.py::test_bench_convergence_shows_what_error_feedback_is_for",
    "test_rejoin.py::test_a_horovod_elastic_script_runs_with_its_import_changed_and_rejoins",
    "test_rejoin.py::test_a_killed_worker_is_restarted_and_rejoins_bitwise_equal",
}


@functools.cache
def _lacks(need: str) -> bool:
    return NEEDS[need]() is not None


def expected_seconds(nodeids: Iterable[str], machine: bool = False) -> float:
    """What a group of tests should take, by their tiers (a test that will skip for a need
    this machine lacks: nothing), to start the longest first; the machine's group counts as
    longer than any."""
    if machine:
        return float("inf")
    total = 0.0
    for nodeid in nodeids:
        test_tags = tags_of_nodeid(nodeid)
        if any(_lacks(t) for t in test_tags if t in NEEDS):
            continue
        path, _, name = nodeid.partition("::")
        key = f"{Path(path).name}::{name.split('[')[0]}"
        tier = "long" if key in LONG_TESTS else "slow" if "slow" in test_tags else "fast"
        total += EXPECTED_TEST_S[tier]
    return total


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` grouped by :func:`group_of_nodeid`. pytest-xdist's own loadgroup
    reads each test's group from a suffix it writes into the test's node id on the worker;
    pytest 9.2 no longer lets a node id be rewritten, so the suffix never arrives and every
    test is scheduled on its own (a module's cluster then starts on each worker). The groups
    come from the ids themselves here, the same with any pytest."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        ordered = False                 # the work queue put longest first (once)

        def _split_scope(self, nodeid: str) -> str:
            return group_of_nodeid(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            # the longest groups first, the machine's (the longest by far) before all: a long
            # group started late holds one worker long after the other has run out of work,
            # and short ones at the end fill the gaps. (pytest-xdist orders them by their
            # number of tests, which puts a module of a few slow tests last.)
            if not self.ordered:
                self.ordered = True
                for group in sorted(self.workqueue, key=lambda g: -expected_seconds(
                        self.workqueue[g], machine=g == MACHINE_GROUP)):
                    self.workqueue.move_to_end(group)
            super()._assign_work_unit(node)

    return ByGroup(config, log)


def namespaces_left_behind(before: set[str]) -> list[str]:
    """The namespaces made since ``before`` whose cluster nobody holds any more (no process
    inside, its builder gone): what a test left behind, whatever another process of the
    machine (a developer's cluster, another test run) holds meanwhile."""
    from bpsctl.launch import emulate
    return [ns for leftover in emulate.find_leftovers()
            if not emulate.owner_alive(leftover.cluster_id)
            and not any(emulate.namespace_pids(name) for name in leftover.namespaces)
            for ns in leftover.namespaces if ns not in before]


@pytest.hookimpl(tryfirst=True)         # before -m selects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item_tags = tags(item)
        item.add_marker(pytest.mark.xdist_group(xdist_group(item_tags, item.path.name)))
        for marker in MARKERS:
            if marker in item_tags:
                item.add_marker(marker)
        for need in NEEDS:
            reason = missing(need) if need in item_tags else None
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
                break


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI as root, a test marked ``root`` that skips has failed (see .ci/run); under CI,
    so has a test that skips for lack of what CI provides (PROVIDED_IN_CI).

    Without root those tests skip, saying why; with root (as CI runs) nothing should stop them.
    """
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and IN_CI):
        return
    if ((item.get_closest_marker("root") is not None and os.geteuid() == 0)
            or tags(item) & PROVIDED_IN_CI):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which should provide what it needs: {reason}"


# --------------------------------------------------------------------------- slow fast tests

#: a test outside ``slow`` that takes longer than this (setup, call and teardown) is named at
#: the end of the run: the fast tier stays fast only if such tests move to ``slow`` or get
#: cheaper (a warning, not a failure: the machine is noisy)
FAST_LIMIT_S = 5.0
_fast_test_seconds: dict[str, float] = {}


_slow_test_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    seconds = _fast_test_seconds if "slow" not in report.keywords else _slow_test_seconds
    seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration


def time_by_group(seconds: dict[str, float]) -> tuple[float, float]:
    """The seconds of the machine's group (run one after another on one xdist worker) and of
    every other test (spread over the workers): the suite's wall time is about the larger of
    the first and the second's share, so this says which one to cut."""
    machine = sum(s for nodeid, s in seconds.items() if group_of_nodeid(nodeid) == MACHINE_GROUP)
    return machine, sum(seconds.values()) - machine


#: how many of its slowest tests a run of the fast tier names at its end, so that a test that
#: grows is seen the day it does (the fast tier's time is the sum of its slowest few)
SLOWEST_SHOWN = 10


def is_fast_tier(config: pytest.Config) -> bool:
    """Whether this run leaves the slow tests out (``-m "not slow"``, alone or with more)."""
    expression = " ".join(str(config.getoption("markexpr", "") or "").split())
    return "not slow" in expression


def slowest(seconds: dict[str, float], count: int = SLOWEST_SHOWN) -> list[tuple[float, str]]:
    """The ``count`` largest of ``seconds`` (test id -> seconds), largest first."""
    return sorted(((s, nodeid) for nodeid, s in seconds.items()), reverse=True)[:count]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """At the end of a run: tests outside ``slow`` over :data:`FAST_LIMIT_S`; on a run of the
    fast tier, its :data:`SLOWEST_SHOWN` slowest tests (setup, call and teardown); on a run
    with slow tests, the time of the machine's group beside the rest, and the slowest tests."""
    over = [(seconds, nodeid)
            for seconds, nodeid in slowest(_fast_test_seconds, count=len(_fast_test_seconds))
            if seconds > FAST_LIMIT_S]
    if over:
        terminalreporter.write_sep("=", f"tests outside `slow` over {FAST_LIMIT_S:g} s",
                                   yellow=True)
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
        terminalreporter.write_line("mark them slow in tests/conftest.py (TIERS), or make them "
                                    "cheaper")
    if is_fast_tier(config) and _fast_test_seconds:
        terminalreporter.write_sep("=", f"the {SLOWEST_SHOWN} slowest tests of the fast tier")
        for seconds, nodeid in slowest(_fast_test_seconds):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
    elif _slow_test_seconds and \
            len(_fast_test_seconds) + len(_slow_test_seconds) > 2 * SLOWEST_SHOWN:
        every = {**_fast_test_seconds, **_slow_test_seconds}
        machine, rest = time_by_group(every)
        terminalreporter.write_sep("=", "where the whole suite's time went")
        terminalreporter.write_line(f"{machine:7.1f} s  the machine's group (one after another, "
                                    "on one worker)")
        terminalreporter.write_line(f"{rest:7.1f} s  every other test (spread over the workers)")
        for seconds, nodeid in slowest(every, count=2 * SLOWEST_SHOWN):
            group = "machine" if group_of_nodeid(nodeid) == MACHINE_GROUP else "       "
            terminalreporter.write_line(f"{seconds:6.1f} s  {group}  {nodeid}")


# --------------------------------------------------------------------------- emulated leftovers



@pytest.fixture(autouse=True)
def _no_abandoned_emulated_clusters(request: pytest.FixtureRequest):
    """Namespaces are machine-wide: an emulated cluster one test leaves behind is what the next
    test's `bpsctl down` finds and reports. Name the test that left it (a warning in the
    summary) and remove it, so that one leak shows up where it happened and nowhere else. A
    fixture's network is held by this live process, so it is never taken."""
    if os.geteuid() != 0 or shutil.which("ip") is None or not tags(request.node) & MACHINE_TAGS:
        yield                   # only the machine's tests build emulated clusters (one at a time)
        return
    from bpsctl.launch import emulate, local

    def sweep(when: str) -> None:
        names = os.listdir(emulate.NETNS_RUN) if emulate.NETNS_RUN.is_dir() else []
        if not any(name.startswith(emulate.NAMESPACE_PREFIX) for name in names):
            return                              # the common case, without running `ip`
        removed, _ = local.remove_abandoned_clusters()
        for cluster_id in removed:
            warnings.warn(f"emulated cluster {cluster_id} was left behind {when} "
                          f"{request.node.nodeid} (removed)", pytest.PytestWarning, stacklevel=1)

    sweep("before")
    yield
    sweep("by")


# --------------------------------------------------------------------------- engine clusters

#: servers in the module-scoped cluster; a job uses the first ``num_servers`` of them
CLUSTER_SERVERS = 4
#: deadlines for worker threads: short enough that a hang fails the test quickly
WORKER_DEADLINES = {"start_timeout_s": 10.0, "heartbeat_interval_s": 0.2,
                    "heartbeat_timeout_s": 5.0, "op_timeout_s": 30.0}
JOB_TIMEOUT_S = 60.0


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: PID 1 here does not reap orphans)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def kill_pids(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_worker_scripts(cluster: api.ClusterState, config: Config, workers: int,
                       script: Path, *args: str, timeout_s: float = 60
                       ) -> tuple[list[subprocess.Popen], list[str]]:
    """Run ``script`` as each of ``workers`` worker processes of ``cluster`` (this checkout's
    bpsctl first on the path) and wait for all of them, within ``timeout_s``; whatever is
    still running then is killed. Returns the processes and their combined outputs."""
    plan = api.worker_plan(cluster, config, workers)
    processes: list[subprocess.Popen] = []
    try:
        for worker in plan.workers:
            env = {**os.environ, **worker.to_env(config, plan),
                   "PYTHONPATH": os.pathsep.join(filter(None, [
                       str(Path(__file__).resolve().parent.parent),
                       os.environ.get("PYTHONPATH")]))}
            processes.append(subprocess.Popen(
                [sys.executable, str(script), *args], env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [p.communicate(timeout=timeout_s)[0] for p in processes]
    finally:
        kill_pids(p.pid for p in processes if p.poll() is None)
        for p in processes:
            p.wait(timeout=10)
    return processes, outputs


def cluster_config(**knobs: Any) -> Config:
    """Config for a test cluster's scheduler and servers."""
    return Config(**{
        "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, "start_timeout_s": 20.0,
        **knobs})


@contextlib.contextmanager
def private_cluster(servers: int, **knobs: Any) -> Iterator[api.ClusterState]:
    """A scheduler and ``servers`` servers of one test's own (``knobs`` over cluster_config;
    a test that kills some passes a short heartbeat_timeout_s); every process it started is
    gone afterwards."""
    with api.local_cluster(cluster_config(**knobs), servers=servers) as state:
        pids = [p.pid for p in state.processes]
        yield state
    kill_pids(pid for pid in pids if not gone(pid))
    wait_until(lambda: all(gone(pid) for pid in pids), 5, "the cluster's processes to exit")


#: how long a :class:`Peer` waits for an answer it expects
PEER_REPLY_MS = 3000


class Peer:
    """A process speaking bpsctl's wire protocol by hand to a real scheduler or server, one
    message at a time (a DEALER socket): for what no well-behaved member sends, or sends in
    an order the network rarely gives."""

    def __init__(self, ctx: zmq.Context, address: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)        # a last LEAVE still goes out on close
        self.sock.connect(f"tcp://{address}")
        self.address = address

    def send(self, msg_type: int, body: dict) -> None:
        self.sock.send_multipart(P.control(msg_type, body))

    def expect(self, wanted: int) -> dict:
        assert self.sock.poll(PEER_REPLY_MS), f"{self.address} did not answer"
        msg_type, body = P.parse_control(self.sock.recv_multipart())
        assert msg_type == wanted, (P.TYPE_NAMES.get(msg_type), body)
        return body

    def replies(self, wait_ms: int, want: int = 1) -> list[int]:
        """The types of the replies that came: waits ``wait_ms`` for each of the first ``want``."""
        types = []
        while self.sock.poll(wait_ms if len(types) < want else 0):
            types.append(P.unpack_header(self.sock.recv_multipart()[0])[0])
        return types

    def prove(self, secret: str) -> None:
        """The hmac handshake, as Login does it."""
        guard = Security("hmac", secret)
        ours = secrets.token_bytes(16)
        self.send(P.AUTH, {"version": bpsctl.__version__, "nonce": ours.hex()})
        theirs = bytes.fromhex(self.expect(P.CHALLENGE)["nonce"])
        self.send(P.PROOF, {"proof": guard._proof(b"connecting", theirs, ours)})

    def close(self) -> None:
        self.sock.close(0)


# worker scripts' check(): records each check's outcome (or traceback) in RESULTS and goes on,
# so one failing check does not hide the others
CHECK_HELPER = textwrap.dedent('''
    def check(fn):
        try:
            fn()
            RESULTS[fn.__name__] = "ok"
        except BaseException as exc:
            RESULTS[fn.__name__] = "".join(traceback.format_exception(exc))[-1500:]
        return fn
''')

@pytest.fixture(scope="module")
def engine_cluster():
    """One real scheduler and four servers for a whole test module; stopped and checked after."""
    with api.local_cluster(cluster_config(), servers=CLUSTER_SERVERS) as cluster:
        pids = [p.pid for p in cluster.processes]
        yield cluster
    kill_pids(pid for pid in pids if not gone(pid))
    assert all(gone(pid) for pid in pids), "the test cluster outlived its fixture"


class JobFailed(AssertionError):
    pass


def exact_integer_step(worker: Worker, grads: list[Any], step: int,
                       prefix: str = "grad") -> None:
    """One step of a two-worker job's integer-valued sums: worker r fills tensor i with
    (r + 1)(step + 1) + i, push_pulls every tensor (named ``prefix`` + i) and checks that each
    came back as the exact sum of both workers', 3 (step + 1) + 2i (float32 holds these exactly,
    so a contribution lost or counted twice shows)."""
    for i, grad in enumerate(grads):
        grad[:] = (worker.rank + 1) * (step + 1) + i
    handles = [worker.push_pull_async(g, name=f"{prefix}{i}", average=False, out=g)
               for i, g in enumerate(grads)]
    for handle in handles:
        worker.synchronize(handle)
    for i, grad in enumerate(grads):
        assert (grad == 3 * (step + 1) + 2 * i).all(), (worker.rank, step, i, grad[:4])


def run_job(cluster: api.ClusterState, workers: int, servers: int,
            body: Callable[[Worker], Any], timeout_s: float = JOB_TIMEOUT_S,
            rank_knobs: dict[int, dict[str, Any]] | None = None, **knobs: Any) -> list[Any]:
    """Run ``body(worker)`` on ``workers`` worker threads of one job using ``servers`` servers
    (``knobs`` for every rank, ``rank_knobs[rank]`` on top for that one).

    Returns each rank's result. If any rank raises, every worker is shut down (so the others
    stop waiting for it) and the first failure is raised, naming its rank. Workers are always
    shut down, so the cluster is free for the next job.
    """
    job_id = f"test-{uuid.uuid4().hex[:12]}"
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    live: dict[int, Worker] = {}
    lock = threading.Lock()
    failed = threading.Event()

    def run_rank(rank: int) -> None:
        config = Config(rank=rank, world_size=workers, job_id=job_id, num_servers=servers,
                        scheduler=cluster.scheduler, secret=cluster.secret,
                        **{**WORKER_DEADLINES, **knobs, **(rank_knobs or {}).get(rank, {})})
        try:
            worker = Worker(config)
        except BaseException as exc:        # noqa: BLE001 - reported to the test below
            errors[rank] = exc
            failed.set()
            return
        with lock:
            live[rank] = worker
        try:
            results[rank] = body(worker)
        except BaseException as exc:        # noqa: BLE001
            errors[rank] = exc
            failed.set()
        finally:
            worker.shutdown()

    threads = [threading.Thread(target=run_rank, args=(rank,), daemon=True,
                                name=f"test-rank-{rank}") for rank in range(workers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if failed.wait(0.05):
            with lock:
                for worker in live.values():
                    worker.shutdown()       # idempotent; fails what the others wait for
            time.sleep(0.05)
    if errors:
        # the first rank to fail (errors keeps the order they came in): the others may only
        # have failed because the loop above shut them down after it
        rank = next(iter(errors))
        raise JobFailed(f"rank {rank} of {workers} (servers {servers}) failed: "
                        f"{errors[rank]!r}") from errors[rank]
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        with lock:
            for worker in live.values():
                worker.shutdown()
        raise JobFailed(f"job did not finish within {timeout_s:g} s: {stuck} still running")
    return [results[rank] for rank in range(workers)]


@pytest.fixture
def job(engine_cluster):
    """``job(workers, servers, body, **knobs)``: :func:`run_job` on the module's cluster."""
    def run(workers: int, servers: int, body: Callable[[Worker], Any], **knobs: Any) -> list[Any]:
        return run_job(engine_cluster, workers, servers, body, **knobs)
    return run

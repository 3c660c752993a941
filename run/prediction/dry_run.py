"""--dry_run: will this run fit, and how fast will it go? The config and the model; a rank's simulated peak
memory by category against the device's, and the nearest change that fits when it does not; FLOPs per
token; the predicted step, on the best basis at hand: a benchmark report's timings of this very
configuration, this machine's CPU measured now (--gpu=cpu), else a roofline of the report's or the GPU
datasheet's figures. --plan and the auto options list or take the fastest candidate that fits."""

import time
import types

from common.datasheet import datasheet
from common.errors import ConfigError
from run.model.presets import flops_per_token, hardware_flops_per_token
from run.options import gpu_memory_gb, launched_world_size, left_to_auto
from run.prediction import plan, probe, roofline
from run.prediction.simulate import BLIND_SPOTS, DDP_ESTIMATE, OFFLOAD_ESTIMATE, simulate
from run.prediction.step_time import announce, measured, reported
from run.progress.progress import describe_model
from run.report_figures import newest_report, read_report

FLOAT8 = (
    "float8: its tensors simulated as torchao makes them (weights gathered in float8 over two ranks or "
    "more); a roofline prices its matmuls at the bf16 rate, as slow as bf16's (a benchmark report's or the "
    "run's own timings measure it)"
)


def report_dry_run(args, shape, model_config, meta_model, names_the_run):
    """Prints the config, the model, the simulated peak memory per GPU, FLOPs per token and a verdict.
    names_the_run: the options whose values make a run what it is. Exit status: 0 fits, 1 does not fit."""
    gpu_name, gpu_gb = gpu_memory_gb(args.gpu)
    world_size = launched_world_size(args)
    n_params = describe_model(args, shape, model_config, meta_model)
    if args.plan or left_to_auto(args):
        started = time.perf_counter()
        if args.gpu != "cpu" and not datasheet(args.gpu) and not args.benchmark_report:
            raise ConfigError(f"--plan and the auto options rank candidates by their step, which nothing "
                              f"gives for --gpu={args.gpu}: name a GPU of the datasheet (e.g. --gpu=H100) or "
                              f"--benchmark_report")  # fmt: skip
        predictor = dry_run_predictor(args, world_size)
        rows = plan.plan(args, model_config, world_size, n_params, gpu_gb, predictor, names_the_run)
        if args.plan:
            return plan.print_plan(rows, args, world_size, gpu_gb, started)
        vars(args).update(chosen := plan.fastest(rows))
        print(f"chose: {plan.flags(chosen)} (the fastest that fits)")
    model_flops = flops_per_token(meta_model, model_config, args.seq_length)
    hardware_flops = hardware_flops_per_token(args, model_config, meta_model, model_flops)
    most = model_flops / hardware_flops
    print(f"FLOPs per token: {model_flops / 1e9:.4g} G for MFU (6·N + 12·L·H·Q·T), "
          f"{hardware_flops / 1e9:.4g} G computed with recomputation: at most {most:.0%} MFU")  # fmt: skip
    started = time.perf_counter()
    memory, work = simulate(args, model_config, world_size, n_params)
    print(f"simulated one training step on fake tensors: world size {world_size}, sharding={args.sharding}, "
          f"{args.mixed_precision}, activation_checkpointing={args.activation_checkpointing}, compile="
          f"{args.compile}, batch {args.batch_size} x {args.seq_length} "
          f"({time.perf_counter() - started:.0f} s)")  # fmt: skip
    for name, gb in memory.items():
        print(f"  {name:<22} {gb:9.3f} GB")
    notes = {DDP_ESTIMATE: args.sharding == "ddp", OFFLOAD_ESTIMATE: args.cpu_offload, FLOAT8: args.float8}
    for note, applies in notes.items():
        if applies:
            print(f"  {note}")
    print(f"not simulated: {BLIND_SPOTS}")
    total = sum(memory.values())
    target = f"{gpu_gb:g} GB ({gpu_name})" if gpu_name else f"{gpu_gb:g} GB"
    print(f"peak memory per GPU (simulated): {total:.1f} GB of {target}")
    if total > gpu_gb:
        return nearest_fit(args, model_config, world_size, n_params, gpu_gb)
    print(f"verdict: fits, {gpu_gb - total:.1f} GB to spare")
    prediction = dry_run_predictor(args, world_size)(args, model_config, work, names_the_run)
    if prediction is None:
        print(f"not predicted: the step, for want of figures of --gpu={args.gpu} (a GPU of the datasheet, or "
              f"--benchmark_report, gives them)")  # fmt: skip
    else:
        announce(args, prediction, world_size, model_flops, datasheet(args.gpu))
    return 0


def dry_run_predictor(args, world_size):
    """How the dry run predicts a candidate's step: predictor(options, model_config, work, names_the_run), a
    Prediction, or None where nothing gives figures of the target (--gpu=80 without a report)."""
    path = args.benchmark_report or newest_report(args.log_dir, args.gpu)
    report = read_report(path) if path else None

    def predictor(options, model_config, work, names_the_run=()):
        same = {name: getattr(options, name) for name in names_the_run}
        accumulation = options.global_batch_size // (options.batch_size * world_size)
        if report and (found := reported(path, report, same, world_size, accumulation)):
            return found
        if options.gpu == "cpu" and not args.benchmark_report:
            found = probe.on_this_cpu(options, model_config, world_size)
            processes = f"{world_size} processes" if world_size > 1 else "one process"
            return measured(found, accumulation, f"this machine's CPU, {processes}")
        figures = roofline.from_report(path, report) if report else None
        figures = figures or (roofline.from_datasheet(options.gpu) if datasheet(options.gpu) else None)
        return roofline.predicted(work, figures, accumulation) if figures else None

    return predictor


def nearest_fit(args, model_config, world_size, n_params, gpu_gb):
    """The verdict of a run that does not fit (exit status 1), with the first change tried that fits, least
    costly first: full activation checkpointing, then smaller micro-batches with more accumulation (the same
    global batch), then offloading the model state to host memory."""
    change = {} if args.activation_checkpointing == "full" else {"activation_checkpointing": "full"}
    changes = [dict(change)] if change else []
    batch = args.batch_size
    while batch > 1:
        batch //= 2
        change["batch_size"] = batch
        changes.append(dict(change))
    if args.sharding != "ddp" and not args.cpu_offload:
        changes.append(dict(change, cpu_offload=True))
    for change in changes:
        candidate = types.SimpleNamespace(**{**vars(args), **change})
        peak = sum(simulate(candidate, model_config, world_size, n_params)[0].values())
        if peak <= gpu_gb:
            print(f"verdict: does not fit; fits with {plan.flags(change)} (simulated {peak:.2f} GB)")
            return 1
    tried = "full activation checkpointing, batch_size 1, cpu_offload"
    print(f"verdict: does not fit, and no change tried fits ({tried}): use more GPUs or a smaller model")
    return 1

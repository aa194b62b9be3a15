"""The drivers of a run: SFT on generated demonstrations and the RL loop, with what the
evaluation scripts share with them. rl/ holds the engine they drive (losses, advantages,
algorithms, sampler, train step, agent, pipeline, checkpoints).

    train.sft.run_sft(config)  -> TrainState     workdir/sft/{checkpoints, metrics.jsonl, events}
    train.rl.run_rl(config)    -> TrainState     workdir/rl/{checkpoints, metrics.jsonl, events}
    train.weights.load_sft_variables / load_rl_variables + train.rollouts.make_rollout_worker
        + rl.pipeline.evaluate:          per-domain pass@1 with 95% intervals (scripts/evaluate.py)

    data.py       the task splits, SFT's demonstrations, the record of what a phase trains on
    workdir.py    run directories: whether a config may resume them, setting a run aside
    run_plan.py   what an RL config asks of the memory planner (model/plan.py)
    phase.py      what every phase shares: start, resume, the global batch over processes
    models.py     the config's model (from a released checkpoint too) and each phase's variant
    state.py      optimizers and train states (RL's with a critic's value head)
    weights.py    where the weights come from: SFT, warm-up, released and RL checkpoints
    rollouts.py   sandbox pool, rollout workers, sampling configs, the rollout-time forward
    sft.py        the SFT driver (run_sft): rows, buckets, stream, supervised phases
    rl.py         the RL driver (run_rl): launcher, update, compiles ahead, evaluation
    launch.py     launch checks (validate_run_config, check_run_config, config_agreement)
    run_config.py the run config's schema: typed frozen sections, defaults, ranges, migration

Both drivers read one run config (configs/rl.py), validated into run_config.RunConfig's frozen
typed sections (a ConfigDict given to them is converted first); run_rl's helpers each get their
own section of it (config.rl, config.rl.agent, config.eval). Every run is resumable: checkpoints hold
the train state (with a critic: the value head and its optimizer state), rng and data-iterator
position; the frozen reference policy is not stored (it is the initial weights, reloaded on
resume). `resume=True` picks up at the last good checkpoint and continues exactly (same data
order, same rng stream), once the workdir's recorded config is found to match on what the phase
depends on (train/workdir.py: else an error naming the fields); `resume=False` moves a previous
run's phase directory aside (train.phase.start_phase).

Scale-out (docs/scaling.md): every driver runs on the mesh of config.sharding
(model.sharding.mesh_from_config; one device for the CPU configs). Parameters are initialised
(or restored) straight into their shardings, the optimizer state is created sharded, the frozen
reference policy is a sharded copy, and the train step, the log-prob forward and the sampler are
MeshJit programs with explicit shardings (the train state donated). In a multi-process job (one
process per host, model.sharding.maybe_initialize_distributed) every process checks at start-up
that all run the same config (train.launch.config_agreement), reads only its own rows of each
global SFT batch (train.sft.sft_stream), iterates the same global RL prompt stream and keeps its
rows (rl.pipeline.host_prompt_slice; a stream that ends on any process ends the job on every
one: train.phase.next_global_batch), generates and scores its own rollouts in its own sandbox
pool, and the global batch the trainer sees is assembled from every process's rows
(model.sharding.to_global); host-side metrics are reduced over processes
(model.sharding.reduce_host_metrics) and written by process 0; evaluation is split over the
processes and gathered once; checkpoints are written and restored sharded by every process.
"""

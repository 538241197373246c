//! A parameter server training a real model, in BSP, SSP and ASP modes, that survives the
//! loss of a server process and of a trainer.
//!
//! `cargo run --release -p examples --bin param-server -- [--slow-factor F] [--steps N]
//! [--staleness S] [--mode bsp|ssp|asp|all] [--no-backup] [--kill-server-at STEP]
//! [--kill-trainer-at STEP] [--no-replacement]` starts six processes on 127.0.0.1: rank 0
//! coordinates and evaluates, ranks 1 and 2 serve the two parameter shards (each the other's
//! backup unless `--no-backup`: primary-backup, an update is acknowledged once both hold it),
//! ranks 3–5 are trainers, the first slowed down by `--slow-factor`. The model is a softmax
//! regression over hashed character 1–3-grams that identifies a word's language (the Debian
//! word lists in `data/wordlang`). For each mode it prints one JSON line with `mode`,
//! `staleness_bound`, `steps_per_s`, `test_accuracy` and `max_staleness_observed`.
//!
//! With `--kill-server-at` or `--kill-trainer-at` (one mode, BSP unless `--mode` says
//! otherwise) it first trains without failures, then again from scratch while it SIGKILLs
//! server 2 (the primary of shard 1 and backup of shard 0) once every trainer has pushed that
//! many steps, and/or trainer 3 (rank 5) once it has; a replacement process for the trainer
//! joins the running group and takes over its index at the others' step (unless
//! `--no-replacement`). The failure run's line adds `baseline_accuracy`, `updates_lost` (pushes
//! acknowledged to the trainers that ran throughout but missing from the final parameters:
//! must be 0), `applied_updates`, `failed_over` and `trainer_rejoined_at`.
//!
//! Under a launcher (`rpcrun --nproc 6 --restart worker -- param-server [--mode M] [--steps N]
//! [--slow-factor F] [--out-dir D]`, on one node or several) every process takes its role
//! from its rank, trains one mode once, and a lost process is started again by its launcher:
//! `launched.rs` says how each role recovers. Rank 0 prints the run's line (`launched: true`,
//! `updates_lost`, `incarnations`, `params_sha256`...) and writes the slowest trainer's step to
//! `D/progress`. `--kill-server-at` and `--kill-trainer-at` make server 2 and trainer 2 SIGKILL
//! themselves, `--freeze-trainer-at` makes trainer 2 SIGSTOP itself (at `--steps`: after its
//! last push; first incarnation only).
//!
//! `--fail-trainer-at STEP` (either mode) makes trainer 2's run end with an error at that step
//! while its process lives on: a trainer's error ends the run at once, naming the trainer
//! (locally the whole run fails; under a launcher the trainer's process exits and is
//! replaced), where the others' BSP pulls would otherwise wait for its steps until their
//! deadline.
//!
//! Layout: `model.rs` the model, shards and trainer loop both modes share, `local.rs` the
//! local mode, `launched.rs` the launched one.

mod launched;
mod local;
mod model;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use collectives::Consistency;
use rpc_core::Registry;

use model::{load, FIRST_TRAINER, TRAINERS};

/// Every function of both modes (every process registers the same ones).
fn registry() -> Result<Registry> {
    model::registry(launched::register)
}

struct Args {
    slow_factor: f64,
    steps: u64,
    staleness: u64,
    modes: Vec<Consistency>,
    backup: bool,
    kill_server_at: Option<u64>,
    kill_trainer_at: Option<u64>,
    freeze_trainer_at: Option<u64>,
    fail_trainer_at: Option<u64>,
    replace_trainer: bool,
    trace: Option<std::path::PathBuf>,
    out_dir: Option<std::path::PathBuf>,
}

const USAGE: &str =
    "param-server: a parameter server over RPC, trained on the word-language data: two \
server processes hold two shards (each the other's backup), three trainer processes pull and push \
under BSP, SSP or ASP; optionally a server and a trainer are killed and recovered.\n\n\
usage: param-server [--slow-factor F] [--steps N] [--staleness S] \
     [--mode bsp|ssp|asp|all] [--no-backup] [--kill-server-at STEP] [--kill-trainer-at STEP] \
     [--no-replacement] [--fail-trainer-at STEP] [--trace PATH] [--out-dir D]\n\n\
Under a launcher (rpcrun --nproc 6 --restart worker -- param-server ...) each process takes \
its role from its rank and a lost one is started again; --out-dir D: rank 0 writes the slowest \
trainer's step to D/progress; --freeze-trainer-at STEP: trainer 2 stops itself (SIGSTOP) there.\n\n\
--fail-trainer-at STEP: trainer 2's run ends with an error there (its process lives on); the \
run then fails at once, naming it.\n\n\
--trace PATH: every process records the job's trace, merged into PATH at the end (Trace Event \
Format, for Perfetto; `rpctrace report PATH` says what held each trainer's step up).";

fn parse_args() -> Result<Args> {
    let mut a = Args {
        slow_factor: 3.0,
        steps: 400,
        staleness: 3,
        modes: Vec::new(),
        backup: true,
        kill_server_at: None,
        kill_trainer_at: None,
        freeze_trainer_at: None,
        fail_trainer_at: None,
        replace_trainer: true,
        trace: None,
        out_dir: None,
    };
    let mut mode = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--slow-factor" => {
                a.slow_factor = value()?.parse().context("--slow-factor takes a number")?
            }
            "--steps" => a.steps = value()?.parse().context("--steps takes an integer")?,
            "--staleness" => {
                a.staleness = value()?.parse().context("--staleness takes an integer")?
            }
            "--mode" => mode = Some(value()?),
            "--no-backup" => a.backup = false,
            "--kill-server-at" => {
                a.kill_server_at = Some(value()?.parse().context("--kill-server-at takes a step")?)
            }
            "--kill-trainer-at" => {
                a.kill_trainer_at =
                    Some(value()?.parse().context("--kill-trainer-at takes a step")?)
            }
            "--freeze-trainer-at" => {
                a.freeze_trainer_at = Some(
                    value()?
                        .parse()
                        .context("--freeze-trainer-at takes a step")?,
                )
            }
            "--fail-trainer-at" => {
                a.fail_trainer_at =
                    Some(value()?.parse().context("--fail-trainer-at takes a step")?)
            }
            "--no-replacement" => a.replace_trainer = false,
            "--trace" => a.trace = Some(value()?.into()),
            "--out-dir" => a.out_dir = Some(value()?.into()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown flag {other:?} (try --help)"),
        }
    }
    if a.slow_factor < 1.0 || a.steps == 0 {
        bail!("--slow-factor must be >= 1 and --steps > 0");
    }
    let launched = launched::under_launcher();
    let faults = a.kill_server_at.is_some()
        || a.kill_trainer_at.is_some()
        || a.fail_trainer_at.is_some()
        || launched;
    let all = [
        Consistency::Bsp,
        Consistency::Ssp(a.staleness),
        Consistency::Asp,
    ];
    a.modes = match mode.as_deref() {
        None if faults => vec![Consistency::Bsp],
        None | Some("all") => all.to_vec(),
        Some("bsp") => vec![all[0]],
        Some("ssp") => vec![all[1]],
        Some("asp") => vec![all[2]],
        Some(m) => bail!("--mode takes bsp, ssp, asp or all, not {m:?}"),
    };
    if faults && a.modes.len() != 1 {
        bail!("a run with failures (or under a launcher) trains one mode: pass --mode bsp|ssp|asp");
    }
    if let Some(d) = &a.out_dir {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    if a.freeze_trainer_at
        .is_some_and(|k| !launched || k > a.steps)
    {
        bail!(
            "--freeze-trainer-at is for a launched run, at a step within 0..={}",
            a.steps
        );
    }
    if launched && (a.trace.is_some() || !a.replace_trainer) {
        bail!(
            "under a launcher, --trace is the launcher's (rpcrun --trace) and a lost trainer is \
             always replaced"
        );
    }
    if a.kill_server_at.is_some() && !a.backup {
        bail!("--kill-server-at needs the backups (without them the shard is lost)");
    }
    for k in [a.kill_server_at, a.kill_trainer_at, a.fail_trainer_at]
        .into_iter()
        .flatten()
    {
        if k == 0 || k >= a.steps {
            bail!("a kill step must be within 1..{} (--steps)", a.steps);
        }
    }
    Ok(a)
}

fn main() {
    // An error is printed naming the program; one no restart can mend exits with rpcrun's
    // fatal status, so that a launcher gives up at once.
    examples::main_with("param-server", || run().map(|()| 0));
}

fn run() -> Result<()> {
    let rt = examples::runtime()?;
    if launched::under_launcher() {
        let args = parse_args()?;
        return rt.block_on(launched::run(&args));
    }
    if examples::is_worker() {
        return rt.block_on(examples::serve_through_failures(
            registry()?,
            Duration::from_secs(300),
        ));
    }
    let args = parse_args()?;
    let test = load("test.tsv")?;
    load("train.tsv")?;
    let mut workers = examples::Workers::spawn_traced(
        FIRST_TRAINER + TRAINERS as u32,
        Vec::new(),
        args.trace.as_deref(),
    )?;
    rt.block_on(async {
        let agent = rpc_core::init(
            workers.rank0_config("master", Duration::from_secs(300)),
            registry()?,
        )
        .await?;
        let result = local::run_modes(&agent, &args, &test, &mut workers).await;
        let report = examples::shutdown_after(&agent, &result).await;
        result?;
        examples::check_shutdown(&agent, &report)
    })?;
    workers.wait_success(Duration::from_secs(60))
}

//! A worker process for the fault tests (`tests/tests/faults.rs`).
//!
//! `fault-worker <role> --rank R --world 3 --rendezvous HOST:PORT`, the secret in `RPC_SECRET`.
//! Rank 1 is the victim the test kills or freezes; ranks 0 and 2 survive it. Every rank prints
//! `READY`, sets up (a parameter on rank 1, a parameter-server shard on rank 0), meets the
//! others at a barrier, then:
//!
//! - `victim`: runs its side of the loops that need it (all-reduces over the world, pushes as
//!   trainer 0 of the shard), prints `RUNNING`, and serves until it is killed.
//! - `survivor`: starts everything that depends on rank 1 at once (an async and a blocking call
//!   that rank 1 never answers, 64 MiB blobs fetched from it in a loop, all-reduces, an RRef
//!   fetch of a value rank 1 is still constructing, distributed backward through rank 1, and on
//!   rank 2 a BSP parameter-server pull that needs rank 1's push), prints `RUNNING`, then
//!   `END <json>` as each ends (`op`, `at_ms` since the epoch, `error`), checks that the
//!   survivors still reach each other (`SURVIVORS_OK`), shuts down and prints `DONE <report>`.
//! - `burner`: (rank 0) has rank 1 compute for 30 s on a runtime thread, then prints
//!   `BURNED <json>` with the workers this rank and rank 1 declared failed meanwhile.
//! - `serve`: serves until every worker has called shutdown.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use autograd_dist::RTensor;
use candle_core::{DType, Device, Tensor};
use integration_tests::autograd_fns::{init_param, linear};
use integration_tests::procs::say;
use integration_tests::rref_fns::make_slow;
use integration_tests::*;
use rpc_core::Agent;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

type Outcome = (&'static str, u64, String);

/// Runs `op` until it fails (a loop) or ends; reports when, and how.
fn watch<F>(name: &'static str, op: F) -> tokio::task::JoinHandle<Outcome>
where
    F: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    tokio::spawn(async move {
        let error = match op.await {
            Ok(()) => "ended without an error".to_owned(),
            Err(e) => format!("{e:#}"),
        };
        (name, now_ms(), error)
    })
}

fn tensor(n: usize) -> Tensor {
    Tensor::ones(n, DType::F32, &Device::Cpu).expect("a tensor")
}

/// All-reduces over the world until one fails.
async fn reduce_loop(agent: Agent) -> anyhow::Result<()> {
    let g = collectives::world(&agent);
    let t = tensor(64 << 10);
    loop {
        g.all_reduce(&t, collectives::ReduceOp::Sum).await?;
    }
}

/// Pulls and pushes as `trainer` of the shard on rank 0 until a call fails or, once a worker
/// has been declared failed, for 3 more steps (the shard goes on without a departed trainer).
async fn train_loop(agent: Agent, trainer: usize) -> anyhow::Result<()> {
    let client = collectives::PsClient::new(&agent, vec![(0, 1)], trainer);
    let mut after_failure = 0;
    for clock in 0.. {
        client.pull(clock).await?;
        client.push(clock, vec![vec![tensor(2)]]).await?;
        if !agent.failed_workers().is_empty() {
            after_failure += 1;
            if after_failure > 3 {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = integration_tests::procs::WorkerArgs::from_env()?;
    let (role, rank) = (args.scenario.clone(), args.rank);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        // Servers wait at the barrier until the driving rank is done.
        let cfg = args.config(Duration::from_secs(if role == "serve" { 90 } else { 10 }));
        let b = integration_tests::rref_fns::register(registry_builder());
        let b = integration_tests::autograd_fns::register(b);
        let registry = collectives::install(b)?.build();
        let agent = rpc_core::init(cfg, registry).await?;
        say(format!("READY {}", agent.name()));
        if rank == 1 {
            agent
                .rpc_async(1u32, init_param, ("w".into(), 4, 4))
                .await?;
        }
        if rank == 0 {
            collectives::serve_shard(
                &agent,
                1,
                vec![tensor(2)],
                0.01,
                collectives::Consistency::Bsp,
                2,
            )?;
        }
        collectives::world(&agent).barrier().await?;
        match role.as_str() {
            "victim" => {
                let _reduce = tokio::spawn(reduce_loop(agent.clone()));
                let _train = tokio::spawn(train_loop(agent.clone(), 0));
                say("RUNNING".into());
                tokio::time::sleep(Duration::from_secs(600)).await;
            }
            "survivor" => survive(&agent, rank).await?,
            "burner" => {
                let start = std::time::Instant::now();
                agent.rpc_async(1u32, burn, (30_000,)).await?;
                let here: Vec<u32> = agent.failed_workers().iter().map(|f| f.rank).collect();
                let there = agent.rpc_async(1u32, failed_ranks, ()).await?;
                say(format!(
                    "BURNED {}",
                    serde_json::json!({
                        "secs": start.elapsed().as_secs_f64(),
                        "failed_here": here,
                        "failed_on_1": there,
                    })
                ));
                let report = agent.shutdown().await;
                say(done_line(&report));
            }
            "serve" => {
                let report = agent.shutdown().await;
                say(done_line(&report));
            }
            other => anyhow::bail!("unknown role {other}"),
        }
        Ok::<_, anyhow::Error>(())
    })
}

/// A survivor: every operation that depends on rank 1, at once; how each ends.
async fn survive(agent: &Agent, rank: u32) -> anyhow::Result<()> {
    let key = 10_000 + u64::from(rank);
    let mut ops = vec![
        watch("async_call", {
            let a = agent.clone();
            async move { Ok(a.rpc_async(1u32, hang, (key, 120)).await?) }
        }),
        watch("blocking_call", {
            let a = agent.clone();
            async move {
                let call = std::thread::spawn(move || a.rpc_sync(1u32, hang, (key + 100, 120)));
                let joined = tokio::task::spawn_blocking(move || call.join()).await?;
                Ok(joined.map_err(|_| anyhow::anyhow!("the calling thread panicked"))??)
            }
        }),
        watch("blob_64MiB", {
            let a = agent.clone();
            async move {
                loop {
                    let b = a.rpc_async(1u32, zeros, (64 << 20,)).await?;
                    anyhow::ensure!(b.len() == 64 << 20, "a short blob");
                }
            }
        }),
        watch("all_reduce", reduce_loop(agent.clone())),
        watch("rref_fetch", {
            let a = agent.clone();
            async move {
                let r = rref::remote(&a, 1u32, make_slow, (key, 1, 120_000))?;
                r.to_here().await?;
                Ok(())
            }
        }),
        watch("backward", {
            let a = agent.clone();
            async move {
                loop {
                    let ctx = autograd_dist::context(&a);
                    let var = candle_core::Var::ones((1, 4), DType::F64, &Device::Cpu)?;
                    let x = RTensor((var.as_tensor() * 1.0)?);
                    let a2 = a.clone();
                    let y = ctx
                        .run(
                            async move { a2.rpc_async(1u32, linear, ("w".into(), x, false)).await },
                        )
                        .await?;
                    ctx.backward(&[y.0.sum_all()?]).await?;
                    ctx.release().await?;
                }
            }
        }),
    ];
    if rank == 2 {
        ops.push(watch("ps_pull", train_loop(agent.clone(), 1)));
    }
    say("RUNNING".into());
    for op in ops {
        let (name, at_ms, error) = op.await?;
        say(format!(
            "END {}",
            serde_json::json!({ "op": name, "at_ms": at_ms, "error": error })
        ));
    }
    // The survivors still reach each other.
    let other = 2 - rank;
    anyhow::ensure!(
        agent.rpc_async(other, add, (20, 22)).await? == 42,
        "a wrong sum"
    );
    say("SURVIVORS_OK".into());
    let report = agent.shutdown().await;
    say(format!(
        "DONE {}",
        serde_json::json!({
            "barrier": format!("{:?}", report.barrier),
            "secs": report.elapsed.as_secs_f64(),
        })
    ));
    Ok(())
}

/// `DONE clean=true`, or `DONE clean=false` and the report, which says why.
fn done_line(report: &rpc_core::ShutdownReport) -> String {
    if report.is_clean() {
        "DONE clean=true".into()
    } else {
        format!("DONE clean=false {report:?}")
    }
}

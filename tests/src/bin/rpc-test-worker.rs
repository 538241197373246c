//! A worker process for the multi-process tests.
//!
//! `rpc-test-worker <scenario> --rank R --world N --rendezvous HOST:PORT [--serve-rendezvous]`
//! with the group secret in `RPC_SECRET` (`--serve-rendezvous`: rank 0 hosts the rendezvous at
//! that address). Prints `READY <name> <addr>` once the group is formed, then:
//! - `serve`: serves until every worker has called shutdown;
//! - `hold`: serves for two minutes without calling shutdown (to be killed);
//! - `watch`: (rank 0) echoes a 1 MiB blob to every peer and prints `BULK <shared blobs>`;
//!   then every rank prints `FAILED <rank> <unix ms>` for each peer declared failed and, after
//!   each, `REACH <rank> ok|<error>` for every peer not declared failed; serves for two
//!   minutes without calling shutdown (to be killed);
//! - `drive`: (rank 0) exercises calls across the processes, prints `RESULT <json>`;
//! - `drive-rref`: (rank 0) shares remote references across the processes in every direction,
//!   drops them, waits for every worker to be quiescent, prints `RESULT <json>`;
//! - `drive-autograd`: (rank 0) runs distributed backward through an MLP split over the three
//!   processes and prints `RESULT <json>` with the largest difference from one-process
//!   gradients;
//! - `drive-kill`: (rank 0) starts a long call to rank 1 from a task and a blocking one from a
//!   plain thread, prints `CALLING`, and once the test has killed rank 1 prints `ERROR <json>`
//!   and `SYNC_ERROR <json>` describing how each call failed;
//! - `drive-grow`: (rank 0 of a group that grows, `RPC_MAX_WORLD_SIZE` above `--world`) waits
//!   for a worker with a new rank to join the running group, calls it, waits for it to leave,
//!   and prints `RESULT <json>` with the changes it saw;
//! - `join-leave`: (a rank past `--world`) joins the running group, calls ranks 0 and 1,
//!   prints `JOINED <sum>`, leaves the group and prints `LEFT clean=<bool>`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use integration_tests::procs::say;
use integration_tests::*;
use rpc_core::{Blob, RpcError};

fn main() -> anyhow::Result<()> {
    let args = integration_tests::procs::WorkerArgs::from_env()?;
    let (scenario, rank, world) = (args.scenario.clone(), args.rank, args.world);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        // Servers wait long at the barrier (until the driver is done); drivers use a short
        // timeout so a killed peer is given up on quickly, except `drive-kill`, whose rank 0
        // must notice the dead peer by itself (AG-5) well within its long timeout.
        let shutdown = match scenario.as_str() {
            "serve" | "drive-kill" => 60,
            _ => 3,
        };
        let cfg = args
            .config(Duration::from_secs(shutdown))
            .with_serve_rendezvous(rank == 0 && args.has("--serve-rendezvous"));
        let registry = integration_tests::autograd_fns::register(
            integration_tests::rref_fns::register(collectives::install(registry_builder())?),
        )
        .build();
        let agent = rpc_core::init(cfg, registry).await?;
        say(format!("READY {} {}", agent.name(), agent.local_addr()));
        match scenario.as_str() {
            "serve" => {}
            "watch" => {
                if rank == 0 {
                    let blob = Blob::from(vec![5u8; 1 << 20]);
                    for peer in 1..world {
                        let back = agent.rpc_async(peer, echo, (blob.clone(),)).await?;
                        anyhow::ensure!(back == blob, "echo from {peer} differs");
                    }
                    say(format!("BULK {}", agent.bulk_stats().shared_blobs));
                }
                let mut watch = agent.watch_failures();
                let until = tokio::time::Instant::now() + Duration::from_secs(120);
                while let Ok(Some(f)) = tokio::time::timeout_at(until, watch.next()).await {
                    let ms = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)?
                        .as_millis();
                    say(format!("FAILED {} {ms}", f.rank));
                    let failed: Vec<u32> = agent.failed_workers().iter().map(|f| f.rank).collect();
                    for peer in (0..world).filter(|p| *p != rank && !failed.contains(p)) {
                        let r = agent.rpc_async(peer, add, (1, 2)).await;
                        say(format!(
                            "REACH {peer} {}",
                            match r {
                                Ok(3) => "ok".to_owned(),
                                Ok(v) => format!("wrong:{v}"),
                                Err(e) => rpc_core::error_chain(&e),
                            }
                        ));
                    }
                }
                return Ok(());
            }
            "drive-grow" => {
                let mut watch = agent.watch_membership();
                let mut seen = Vec::new();
                let until = tokio::time::Instant::now() + Duration::from_secs(60);
                let mut newcomer = None;
                while let Ok(Some(e)) = tokio::time::timeout_at(until, watch.next()).await {
                    seen.push(serde_json::json!({
                        "generation": e.generation,
                        "rank": e.rank,
                        "name": e.name,
                        "incarnation": e.incarnation,
                        "change": format!("{:?}", e.change)
                            .split([' ', '{'])
                            .next()
                            .unwrap_or_default()
                            .to_owned(),
                    }));
                    match e.change {
                        rpc_core::MembershipChange::Joined { .. } => {
                            let who = agent.rpc_async(e.rank, whoami, ()).await?;
                            let sum = agent.rpc_async(e.rank, add, (20, 22)).await?;
                            newcomer = Some(serde_json::json!({ "whoami": who, "sum": sum }));
                        }
                        rpc_core::MembershipChange::Left => break,
                        _ => {}
                    }
                }
                say(format!(
                    "RESULT {}",
                    serde_json::json!({
                        "changes": seen,
                        "newcomer": newcomer,
                        "world_size": agent.world_size(),
                        "members": agent.worker_infos().len(),
                    })
                ));
            }
            "join-leave" => {
                let sum = agent.rpc_async(0u32, add, (1, 2)).await?
                    + agent.rpc_async(1u32, add, (3, 4)).await?;
                say(format!("JOINED {sum}"));
                let left = agent.leave().await?;
                say(format!("LEFT clean={}", left.is_clean()));
                return Ok(());
            }
            "hold" => {
                // Serve without ever reaching the shutdown barrier (the test kills us).
                tokio::time::sleep(Duration::from_secs(120)).await;
            }
            "drive" => {
                let sum = agent.rpc_async("worker1", add, (40, 2)).await?;
                let hops = agent.rpc_async(2u32, chain, (50, 1, 2)).await?;
                let bytes: Vec<u8> = (0..(4 << 20)).map(|i: u32| (i % 253) as u8).collect();
                let big = Blob::from(bytes);
                let echoed = agent.rpc_async(1u32, echo, (big.clone(),)).await?;
                // Between processes on one host, blobs switch to shared memory once the peer has
                // mapped our arena; a blob built there for the peer travels without a copy.
                let mut rounds = 0;
                while agent.bulk_stats().shared_blobs == 0 && rounds < 50 {
                    rounds += 1;
                    let again = agent.rpc_async(1u32, echo, (big.clone(),)).await?;
                    anyhow::ensure!(again == big, "echo {rounds} differs");
                }
                let staged = agent.blob_for(1u32, big.len(), |b| b.copy_from_slice(&big))?;
                let staged_echo = agent.rpc_async(1u32, echo, (staged.clone(),)).await?;
                let who = agent.rpc_async(2u32, whoami, ()).await?;
                let err = agent
                    .rpc_async(1u32, fail, ("p".into(),))
                    .await
                    .unwrap_err();
                let remote = err
                    .as_remote()
                    .cloned()
                    .context("expected a remote error")?;
                let panic = agent
                    .rpc_async(2u32, boom, ("oops".into(),))
                    .await
                    .unwrap_err();
                let after_panic = agent.rpc_async(2u32, add, (1, 1)).await?;
                say(format!(
                    "RESULT {}",
                    serde_json::json!({
                        "sum": sum,
                        "hops": hops,
                        "echo_ok": echoed == big,
                        "shared_echo_ok": staged_echo == big && staged == big,
                        "shared_blobs": agent.bulk_stats().shared_blobs,
                        "whoami": who,
                        "error_worker": remote.worker,
                        "error_chain": remote.chain,
                        "panic_kind": format!("{:?}", panic.as_remote().map(|r| r.kind)),
                        "after_panic": after_panic,
                    })
                ));
            }
            "drive-rref" => {
                use integration_tests::rref_fns as f;
                let ns = 77;
                // Created by rank 0, owned by rank 1.
                let r = rref::remote(&agent, 1u32, f::make, (ns, 9))?;
                // user→user (0 → 2) before confirmation, user→owner (0 → 1).
                agent.rpc_async(2u32, f::keep, (1, r.clone())).await?;
                agent.rpc_async(1u32, f::keep, (1, r.clone())).await?;
                let read_by_2 = agent.rpc_async(2u32, f::read_id, (r.clone(),)).await?;
                let method = r.rpc_async(f::id_of, ()).await?;
                // A reference in a result, from rank 2 back to rank 0.
                let back = agent
                    .rpc_async(2u32, f::give, (1,))
                    .await?
                    .context("kept on rank 2")?;
                let fetched = back.to_here().await?.id;
                drop((r, back));
                for w in 0..3u32 {
                    agent.rpc_async(w, f::release_all, ()).await?;
                }
                let deadline = Instant::now() + Duration::from_secs(20);
                let quiet = loop {
                    let mut total = 0;
                    for w in 0..3u32 {
                        let (a, b, c, d, e) = agent.rpc_async(w, f::rref_debug, ()).await?;
                        total += a + b + c + d + e;
                    }
                    if total == 0 || Instant::now() > deadline {
                        break total == 0;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                };
                say(format!(
                    "RESULT {}",
                    serde_json::json!({
                        "read_by_2": read_by_2,
                        "method": method,
                        "fetched": fetched,
                        "quiescent": quiet,
                    })
                ));
            }
            "drive-autograd" => {
                use autograd_dist::RTensor;
                use integration_tests::autograd_fns as f;
                let shapes = [(0u32, "p.w0", 4, 8), (1, "p.w1", 8, 6), (2, "p.w2", 6, 3)];
                for (w, name, r, c) in shapes {
                    agent
                        .rpc_async(w, f::init_param, (name.to_string(), r, c))
                        .await?;
                }
                let x = f::input(5, 4);
                let ctx = autograd_dist::context(&agent);
                let loss = ctx
                    .run(async {
                        let x = RTensor(x.clone());
                        let h0 = agent
                            .rpc_async(0u32, f::linear, ("p.w0".into(), x, true))
                            .await?;
                        let h1 = agent
                            .rpc_async(1u32, f::linear, ("p.w1".into(), h0, true))
                            .await?;
                        let h2 = agent
                            .rpc_async(2u32, f::linear, ("p.w2".into(), h1, false))
                            .await?;
                        anyhow::Ok(h2.0.sqr()?.mean_all()?)
                    })
                    .await?;
                ctx.backward(&[loss]).await?;
                let vars: Vec<_> = [("p.w0", 4, 8), ("p.w1", 8, 6), ("p.w2", 6, 3)]
                    .iter()
                    .map(|(n, r, c)| candle_core::Var::from_tensor(&f::init_value(n, *r, *c)))
                    .collect::<Result<_, _>>()?;
                let local = x
                    .matmul(vars[0].as_tensor())?
                    .relu()?
                    .matmul(vars[1].as_tensor())?
                    .relu()?
                    .matmul(vars[2].as_tensor())?
                    .sqr()?
                    .mean_all()?;
                let g = local.backward()?;
                let mut worst = 0f64;
                for (w, (name, v)) in ["p.w0", "p.w1", "p.w2"].iter().zip(&vars).enumerate() {
                    let remote = agent
                        .rpc_async(w as u32, f::param_grad, (ctx.id(), name.to_string()))
                        .await?
                        .context("missing gradient")?;
                    let d = (remote.0 - g.get(v.as_tensor()).context("missing local gradient")?)?
                        .abs()?
                        .flatten_all()?
                        .max(0)?
                        .to_scalar::<f64>()?;
                    worst = worst.max(d);
                }
                ctx.release().await?;
                say(format!(
                    "RESULT {}",
                    serde_json::json!({ "max_abs_diff": worst })
                ));
            }
            "drive-kill" => {
                // One call from a task, and one blocking call from a plain thread (on the
                // thread's own connection), both in flight when rank 1 is killed.
                let call = agent.rpc_async(1u32, hang, (1, 60));
                let a = agent.clone();
                let blocking = std::thread::spawn(move || a.rpc_sync(1u32, hang, (2, 60)));
                say("CALLING".into());
                let start = Instant::now();
                let describe = |err: &RpcError| {
                    let kind = match err {
                        RpcError::ConnectionLost { worker, .. } => {
                            format!("ConnectionLost:{worker}")
                        }
                        RpcError::PeerFailed { worker, .. } => format!("PeerFailed:{worker}"),
                        e => format!("{e:?}"),
                    };
                    serde_json::json!({
                        "kind": kind,
                        "message": rpc_core::error_chain(err),
                        "after_ms": start.elapsed().as_millis() as u64,
                    })
                };
                let err = match call.await {
                    Ok(()) => bail!("the call to a killed worker succeeded"),
                    Err(e) => e,
                };
                say(format!("ERROR {}", describe(&err)));
                let err = match tokio::task::spawn_blocking(move || blocking.join()).await {
                    Ok(Ok(Err(e))) => e,
                    Ok(Ok(Ok(()))) => bail!("the blocking call to a killed worker succeeded"),
                    _ => bail!("the blocking caller panicked"),
                };
                say(format!("SYNC_ERROR {}", describe(&err)));
            }
            other => bail!("unknown scenario {other}"),
        }
        let report = agent.shutdown().await;
        say(format!(
            "SHUTDOWN clean={} barrier={:?}",
            report.is_clean(),
            report.barrier
        ));
        Ok(())
    })
}

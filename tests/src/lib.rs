//! Remote functions and helpers shared by the integration tests and `rpc-test-worker`.
//!
//! The functions live here, in one module, so that every process (test binary or worker
//! binary) registers them under the same `module_path!()` names.
#![deny(missing_docs)]

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

pub mod autograd_fns;
pub mod elastic;
pub mod procs;
pub mod rref_fns;

/// The README's Rust snippets, compiled (and run where they can be) as doc tests, so the
/// README stays true to the API.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeSnippets;

/// The Rust of every page under `docs/`, compiled (and run where it can be) as doc tests.
#[cfg(doctest)]
pub mod doc_pages {
    /// `docs/use-in-your-crate.md`.
    #[doc = include_str!("../../docs/use-in-your-crate.md")]
    pub struct UseInYourCrate;
    /// `docs/guide.md`.
    #[doc = include_str!("../../docs/guide.md")]
    pub struct Guide;
    /// `docs/failures.md`.
    #[doc = include_str!("../../docs/failures.md")]
    pub struct Failures;
    /// `docs/recovery.md`.
    #[doc = include_str!("../../docs/recovery.md")]
    pub struct Recovery;
    /// `docs/pipelines.md`.
    #[doc = include_str!("../../docs/pipelines.md")]
    pub struct Pipelines;
    /// `docs/data-parallelism.md`.
    #[doc = include_str!("../../docs/data-parallelism.md")]
    pub struct DataParallelism;
    /// `docs/benchmarks.md`.
    #[doc = include_str!("../../docs/benchmarks.md")]
    pub struct Benchmarks;
    /// `docs/tracing.md`.
    #[doc = include_str!("../../docs/tracing.md")]
    pub struct Tracing;
    /// `docs/architecture.md`.
    #[doc = include_str!("../../docs/architecture.md")]
    pub struct Architecture;
}

use rpc_core::ext::AgentExt;
use rpc_core::{remote, Blob, BoxError, CallContext, Registry};
use serde::{Deserialize, Serialize};

/// The CUDA devices a GPU test may use, or `None` (the test then returns at once, having
/// said why on stderr): GPU tests are skipped with a message where there is no GPU, never
/// passed silently. With `RPC_EXPECT_GPU=1` (set by `scripts/gpu-check.sh`) a missing GPU
/// fails the test instead, naming the cause. `at_least` is the number of GPUs the test needs.
pub fn gpus(test: &str, at_least: usize) -> Option<usize> {
    gpus_expected(
        test,
        at_least,
        std::env::var("RPC_EXPECT_GPU").is_ok_and(|v| v == "1"),
    )
}

/// [`gpus`], with whether a GPU is expected given rather than read from the environment.
pub fn gpus_expected(test: &str, at_least: usize, expected: bool) -> Option<usize> {
    let why = match autograd_dist::cuda_devices() {
        Ok(n) if n >= at_least => return Some(n),
        Ok(n) => format!("it needs {at_least} CUDA devices, this machine has {n}"),
        Err(e) => e.to_string(),
    };
    // Fewer GPUs than a test needs is a skip even when GPUs are expected; none is not.
    let none = !matches!(autograd_dist::cuda_devices(), Ok(n) if n > 0);
    if expected && none {
        panic!("GPU test {test}: a GPU was expected (RPC_EXPECT_GPU=1) but {why}");
    }
    eprintln!("GPU test {test} skipped: {why}");
    None
}

/// Runs `f` on a fresh multi-threaded runtime and fails the test if it takes longer than
/// `secs` seconds. Every async test goes through this.
pub fn run<F: Future>(secs: u64, f: F) -> F::Output {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(secs), f)
            .await
            .unwrap_or_else(|_| panic!("test timed out after {secs} s"))
    })
}

/// Runs `body` once per transport (TCP on 127.0.0.1, then the in-memory network), each run
/// bounded by `secs` seconds.
pub fn each_transport<F, Fut>(secs: u64, mut body: F)
where
    F: FnMut(rpc_core::Transport) -> Fut,
    Fut: Future<Output = ()>,
{
    for t in rpc_core::testing::transports() {
        eprintln!("-- over {}", rpc_core::testing::transport_name(&t));
        run(secs, body(t));
    }
}

/// `n` in-process workers on `t` with the collectives' functions installed and a 20 s call
/// timeout (so a test that waits for a timeout shows it).
pub async fn collective_group(n: u32, t: rpc_core::Transport) -> Vec<rpc_core::Agent> {
    rpc_core::testing::start_group(
        n,
        t,
        rpc_core::Secret::generate(),
        |_| {
            collectives::install(rpc_core::Registry::builder())
                .expect("installs")
                .build()
        },
        |_, c| c.with_rpc_timeout(Duration::from_secs(20)),
    )
    .await
    .expect("group starts")
}

/// Shuts every agent down together and asserts each shutdown was clean.
pub async fn shutdown_all(agents: &[rpc_core::Agent]) {
    for r in futures::future::join_all(agents.iter().map(|a| a.shutdown())).await {
        assert!(r.is_clean(), "unclean shutdown: {r:?}");
    }
}

/// Adds two numbers.
#[remote]
pub async fn add(_ctx: CallContext, a: i32, b: i32) -> Result<i32, BoxError> {
    Ok(a + b)
}

/// Adds two 64-bit numbers: same name shape as `add`, different types.
#[remote(name = "integration_tests::add")]
pub async fn add_i64(_ctx: CallContext, a: i64, b: i64) -> Result<i64, BoxError> {
    Ok(a + b)
}

/// `add` with a different result type, to provoke a result mismatch.
#[remote(name = "integration_tests::add")]
pub async fn add_as_string(_ctx: CallContext, a: i32, b: i32) -> Result<String, BoxError> {
    Ok((a + b).to_string())
}

/// Returns its argument.
#[remote]
pub async fn echo(_ctx: CallContext, data: Blob) -> Result<Blob, BoxError> {
    Ok(data)
}

/// A struct with blobs nested inside.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Packet {
    /// A label.
    pub label: String,
    /// Payloads.
    pub parts: Vec<Blob>,
}

/// Reverses the parts of a packet and sums their lengths.
#[remote]
pub async fn reverse_parts(_ctx: CallContext, mut p: Packet) -> Result<(Packet, u64), BoxError> {
    p.parts.reverse();
    let total = p.parts.iter().map(|b| b.len() as u64).sum();
    Ok((p, total))
}

/// The incarnation of the worker that serves the call.
#[remote]
pub async fn incarnation_here(ctx: CallContext) -> Result<u64, BoxError> {
    Ok(ctx.agent().incarnation())
}

/// Returns the caller's name and this worker's name.
#[remote]
pub async fn whoami(ctx: CallContext) -> Result<(String, String), BoxError> {
    Ok((ctx.caller().name.clone(), ctx.agent().name().to_owned()))
}

/// Returns the value of call metadata `key` as this worker sees it, and as the worker `next`
/// sees it from a nested call (if `next` is given).
#[remote]
pub async fn meta_seen(
    ctx: CallContext,
    key: String,
    next: Option<u32>,
) -> Result<(Option<Vec<u8>>, Option<Vec<u8>>), BoxError> {
    let here = rpc_core::ext::call_meta(&key);
    let nested = match next {
        Some(n) => ctx.agent().rpc_async(n, meta_seen, (key, None)).await?.0,
        None => None,
    };
    Ok((here, nested))
}

/// Returns `n` zero bytes (a result much larger than its arguments).
#[remote]
pub async fn zeros(_ctx: CallContext, n: usize) -> Result<Blob, BoxError> {
    Ok(Blob::from(vec![0u8; n]))
}

/// Blobs a worker keeps alive on purpose (see [`hold`]).
#[derive(Default)]
pub struct Held(pub Mutex<Vec<Blob>>);

/// Keeps `data` alive on the callee until [`release_held`]; returns its checksum.
#[remote]
pub async fn hold(ctx: CallContext, data: Blob) -> Result<u64, BoxError> {
    let sum = data.iter().map(|&b| u64::from(b)).sum();
    let held = ctx.agent().extension(Held::default);
    held.0.lock().unwrap_or_else(|p| p.into_inner()).push(data);
    Ok(sum)
}

/// Drops what [`hold`] kept; returns the checksums of the blobs, read only now.
#[remote]
pub async fn release_held(ctx: CallContext) -> Result<Vec<u64>, BoxError> {
    let held = ctx.agent().extension(Held::default);
    let blobs = std::mem::take(&mut *held.0.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(blobs
        .iter()
        .map(|b| b.iter().map(|&x| u64::from(x)).sum())
        .collect())
}

/// Sleeps `ms` milliseconds, then returns `ms`.
#[remote]
pub async fn sleep_ms(_ctx: CallContext, ms: u64) -> Result<u64, BoxError> {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Ok(ms)
}

#[derive(Debug, thiserror::Error)]
#[error("disk quota exceeded")]
struct Quota;

#[derive(Debug, thiserror::Error)]
#[error("could not save checkpoint {0}")]
struct Save(String, #[source] Quota);

/// Fails with a two-level error chain.
#[remote]
pub async fn fail(_ctx: CallContext, name: String) -> Result<(), BoxError> {
    Err(Box::new(Save(name, Quota)))
}

/// Fails through `anyhow`, to show `?` works with it.
#[remote]
pub async fn fail_anyhow(_ctx: CallContext) -> Result<(), anyhow::Error> {
    let n: u32 = "not a number"
        .parse()
        .map_err(|e| anyhow::anyhow!("parsing the step: {e}"))?;
    let _ = n;
    Ok(())
}

/// Panics.
#[remote]
pub async fn boom(_ctx: CallContext, msg: String) -> Result<(), BoxError> {
    panic!("{msg}");
}

/// Ping-pongs between ranks `a` and `b` for `remaining` more hops; returns the hop count.
#[remote]
pub async fn chain(ctx: CallContext, remaining: u32, a: u32, b: u32) -> Result<u32, BoxError> {
    if remaining == 0 {
        return Ok(0);
    }
    let next = if ctx.agent().rank() == a { b } else { a };
    let n = ctx
        .agent()
        .rpc_async(next, chain, (remaining - 1, a, b))
        .await?;
    Ok(n + 1)
}

/// Reports the time left before this call's deadline, in milliseconds.
#[remote]
pub async fn remaining_ms(ctx: CallContext) -> Result<Option<u64>, BoxError> {
    Ok(ctx.remaining().map(|d| d.as_millis() as u64))
}

/// Adds `a + b` on `target` with a blocking call made from inside this handler (as code that
/// is not async, called from a handler, would).
#[remote]
pub async fn add_blocking_on(
    ctx: CallContext,
    target: u32,
    a: i32,
    b: i32,
) -> Result<i32, BoxError> {
    Ok(ctx.agent().rpc_sync(target, add, (a, b))?)
}

/// Calls `remaining_ms` on `target` (with the default timeout) and returns what it saw.
#[remote]
pub async fn nested_remaining_ms(ctx: CallContext, target: u32) -> Result<Option<u64>, BoxError> {
    Ok(ctx.agent().rpc_async(target, remaining_ms, ()).await?)
}

/// Calls `remaining_ms` on `target` from a task this handler spawns with [`rpc_core::spawn`]
/// (`bare`: with a plain `tokio::spawn`, which starts outside the call), and returns what it
/// saw.
#[remote]
pub async fn spawned_remaining_ms(
    ctx: CallContext,
    target: u32,
    bare: bool,
) -> Result<Option<u64>, BoxError> {
    let a = ctx.agent().clone();
    let call = async move { a.rpc_async(target, remaining_ms, ()).await };
    let task = if bare {
        tokio::spawn(call)
    } else {
        rpc_core::spawn(call)
    };
    Ok(task.await??)
}

/// Sums `x` over the group of `ranks` with `all_reduce_async` (a task of the library's), from
/// inside this handler.
#[remote]
pub async fn all_reduce_in_background(
    ctx: CallContext,
    ranks: Vec<u32>,
    x: Vec<f32>,
) -> Result<Vec<f32>, BoxError> {
    let g = collectives::new_group(ctx.agent(), &ranks)?;
    let t = candle_core::Tensor::new(x.as_slice(), &candle_core::Device::Cpu)?;
    let sum = g
        .all_reduce_async(&t, collectives::ReduceOp::Sum)
        .wait()
        .await?;
    Ok(sum.to_vec1()?)
}

/// Bytes carried in a call's payload (not as a blob).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Bytes(#[serde(with = "serde_bytes")] pub Vec<u8>);

/// Waits `ms` milliseconds holding `data`, then returns its length: a call that keeps its
/// arguments' memory while it waits.
#[remote]
pub async fn wait_holding(_ctx: CallContext, data: Bytes, ms: u64) -> Result<u64, BoxError> {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Ok(data.0.len() as u64)
}

/// Bounds this worker's mailbox: `max_bytes` per sender, messages kept `max_age_ms`.
#[remote]
pub async fn limit_mailbox(
    ctx: CallContext,
    max_bytes: usize,
    max_age_ms: u64,
) -> Result<(), BoxError> {
    let limits = collectives::MailboxLimits::new(max_bytes, Duration::from_millis(max_age_ms));
    collectives::set_mailbox_limits(ctx.agent(), limits);
    Ok(())
}

/// This worker's mailbox: messages and bytes waiting for a receive, messages expired.
#[remote]
pub async fn mailbox_held(ctx: CallContext) -> Result<(usize, usize, u64), BoxError> {
    let s = collectives::mailbox_stats(ctx.agent());
    Ok((s.queued_messages, s.queued_bytes, s.expired_messages))
}

fn cancelled() -> &'static Mutex<HashSet<u64>> {
    static C: OnceLock<Mutex<HashSet<u64>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// Whether the `hang` call with this key was dropped (cancelled) on the callee.
pub fn was_cancelled(key: u64) -> bool {
    cancelled().lock().unwrap().contains(&key)
}

struct OnDrop(u64);
impl Drop for OnDrop {
    fn drop(&mut self) {
        cancelled().lock().unwrap().insert(self.0);
    }
}

/// Waits `secs` seconds; records `key` as cancelled if the handler is dropped before then.
#[remote]
pub async fn hang(_ctx: CallContext, key: u64, secs: u64) -> Result<(), BoxError> {
    let guard = OnDrop(key);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    std::mem::forget(guard);
    Ok(())
}

/// Computes (spins on its runtime thread, never yielding) for `ms` milliseconds.
#[remote]
pub async fn burn(_ctx: CallContext, ms: u64) -> Result<u64, BoxError> {
    let until = std::time::Instant::now() + Duration::from_millis(ms);
    let mut n = 0u64;
    while std::time::Instant::now() < until {
        n = n.wrapping_add(1);
        std::hint::spin_loop();
    }
    Ok(n)
}

/// A text of `n` bytes: a large result that is not a blob (it rides in the frame itself).
#[remote]
pub async fn big_text(_ctx: CallContext, n: usize) -> Result<String, BoxError> {
    Ok("t".repeat(n))
}

/// The ranks this worker's failure detector declared failed.
#[remote]
pub async fn failed_ranks(ctx: CallContext) -> Result<Vec<u32>, BoxError> {
    Ok(ctx
        .agent()
        .failed_workers()
        .iter()
        .map(|f| f.rank)
        .collect())
}

/// A type whose serialization always fails: proves that self-calls skip serialization.
#[derive(Debug, Deserialize)]
pub struct Unserializable(pub u32);

impl Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _s: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "Unserializable cannot be serialized",
        ))
    }
}

/// Doubles the number inside an [`Unserializable`].
#[remote]
pub async fn double_local(_ctx: CallContext, v: Unserializable) -> Result<u32, BoxError> {
    Ok(v.0 * 2)
}

/// The registry every test worker serves.
pub fn registry() -> Registry {
    registry_builder().build()
}

/// The test functions, ready for more to be added.
pub fn registry_builder() -> rpc_core::RegistryBuilder {
    Registry::builder()
        .register(add)
        .and_then(|r| r.register(echo))
        .and_then(|r| r.register(reverse_parts))
        .and_then(|r| r.register(whoami))
        .and_then(|r| r.register(incarnation_here))
        .and_then(|r| r.register(sleep_ms))
        .and_then(|r| r.register(fail))
        .and_then(|r| r.register(fail_anyhow))
        .and_then(|r| r.register(boom))
        .and_then(|r| r.register(chain))
        .and_then(|r| r.register(remaining_ms))
        .and_then(|r| r.register(nested_remaining_ms))
        .and_then(|r| r.register(spawned_remaining_ms))
        .and_then(|r| r.register(wait_holding))
        .and_then(|r| r.register(limit_mailbox))
        .and_then(|r| r.register(mailbox_held))
        .and_then(|r| r.register(all_reduce_in_background))
        .and_then(|r| r.register(hang))
        .and_then(|r| r.register(burn))
        .and_then(|r| r.register(failed_ranks))
        .and_then(|r| r.register(big_text))
        .and_then(|r| r.register(double_local))
        .and_then(|r| r.register(zeros))
        .and_then(|r| r.register(meta_seen))
        .and_then(|r| r.register(hold))
        .and_then(|r| r.register(release_held))
        .and_then(|r| r.register(add_blocking_on))
        .expect("test functions have distinct names")
}

/// The largest absolute difference between two `f64` tensors of one shape (for comparing a
/// distributed run with one process).
pub fn max_abs_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f64 {
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f64>())
        .expect("two f64 tensors of one shape")
}

/// Parameter-server test trainer `t`'s regression sample for `step`: features and target.
pub fn ps_sample(t: usize, step: u64) -> (Vec<f64>, f64) {
    let x: Vec<f64> = (0..4)
        .map(|i| (((t * 7 + i * 3 + step as usize) % 11) as f64 / 11.0) - 0.4)
        .collect();
    (x, (t as f64 + 1.0) * 0.25)
}

/// Parameter-server test trainer `t`'s gradient of `(x . w - y)^2` for the full weights `w`.
pub fn ps_grad(w: &[f64], t: usize, step: u64) -> Vec<f64> {
    let (x, y) = ps_sample(t, step);
    let err = x.iter().zip(w).map(|(a, b)| a * b).sum::<f64>() - y;
    x.iter().map(|a| 2.0 * err * a).collect()
}

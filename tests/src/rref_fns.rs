//! Remote functions over remote references, shared by the RRef tests and the stress program.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use rpc_core::ext::AgentExt;
use rpc_core::{remote, BoxError, CallContext};
use rref::RRef;
use serde::{Deserialize, Serialize};

fn live_counts() -> &'static Mutex<HashMap<u64, i64>> {
    static L: OnceLock<Mutex<HashMap<u64, i64>>> = OnceLock::new();
    L.get_or_init(Default::default)
}

/// Values alive in namespace `ns` (made by a constructor, not yet dropped).
pub fn live(ns: u64) -> i64 {
    live_counts().lock().unwrap().get(&ns).copied().unwrap_or(0)
}

/// Counts one live constructed value; copies (clones, deserialized values) carry none.
#[derive(Debug)]
pub struct LiveToken(u64);

impl LiveToken {
    fn new(ns: u64) -> Self {
        *live_counts().lock().unwrap().entry(ns).or_insert(0) += 1;
        Self(ns)
    }
}

impl Drop for LiveToken {
    fn drop(&mut self) {
        *live_counts().lock().unwrap().entry(self.0).or_insert(0) -= 1;
    }
}

/// A value whose constructed instances are counted per namespace.
#[derive(Debug, Serialize, Deserialize)]
pub struct Tracked {
    /// Identity, checked when read.
    pub id: u64,
    /// Payload, derived from `id`.
    pub data: Vec<u64>,
    #[serde(skip)]
    live: Option<LiveToken>,
}

impl Clone for Tracked {
    fn clone(&self) -> Self {
        Self {
            id: self.id,
            data: self.data.clone(),
            live: None,
        }
    }
}

impl PartialEq for Tracked {
    fn eq(&self, o: &Self) -> bool {
        self.id == o.id && self.data == o.data
    }
}

/// The payload a `Tracked` with this id must carry.
pub fn expected_data(id: u64) -> Vec<u64> {
    (0..(id % 7 + 1))
        .map(|i| id.wrapping_mul(31).wrapping_add(i))
        .collect()
}

impl Tracked {
    /// A counted value.
    pub fn new(ns: u64, id: u64) -> Self {
        Self {
            id,
            data: expected_data(id),
            live: Some(LiveToken::new(ns)),
        }
    }

    /// Whether this instance is a counted original (not a copy).
    pub fn is_counted(&self) -> bool {
        self.live.is_some()
    }

    /// Whether the payload matches the id.
    pub fn is_intact(&self) -> bool {
        self.data == expected_data(self.id)
    }
}

/// Constructor: a counted value.
#[remote]
pub async fn make(_ctx: CallContext, ns: u64, id: u64) -> Result<Tracked, BoxError> {
    Ok(Tracked::new(ns, id))
}

/// Constructor that takes a while.
#[remote]
pub async fn make_slow(_ctx: CallContext, ns: u64, id: u64, ms: u64) -> Result<Tracked, BoxError> {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Ok(Tracked::new(ns, id))
}

/// Constructor that fails.
#[remote]
pub async fn make_fail(_ctx: CallContext, why: String) -> Result<Tracked, BoxError> {
    Err(why.into())
}

/// Method: reads the value (runs on the owner).
#[remote]
pub async fn id_of(_ctx: CallContext, this: RRef<Tracked>) -> Result<u64, BoxError> {
    let v = this.local_value().await?;
    let g = v.lock().await;
    Ok(g.id)
}

/// Method: appends to the value's payload, returns the new length (runs on the owner).
#[remote]
pub async fn push(_ctx: CallContext, this: RRef<Tracked>, x: u64) -> Result<usize, BoxError> {
    let v = this.local_value().await?;
    let mut g = v.lock().await;
    g.data.push(x);
    Ok(g.data.len())
}

/// Method producing a new value from the target and another reference (a pipeline stage).
#[remote]
pub async fn combine(
    _ctx: CallContext,
    this: RRef<Tracked>,
    other: RRef<Tracked>,
    ns: u64,
) -> Result<Tracked, BoxError> {
    let a = this.local_value().await?.lock().await.id;
    let b = other.to_here().await?.id;
    Ok(Tracked::new(ns, a * 1000 + b))
}

/// Fetches a reference's value here and returns its id.
#[remote]
pub async fn read_id(_ctx: CallContext, r: RRef<Tracked>) -> Result<u64, BoxError> {
    let v = r.to_here().await?;
    if !v.is_intact() {
        return Err(format!("value {} is corrupt", v.id).into());
    }
    Ok(v.id)
}

/// References nested in a struct.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Bundle {
    /// A label.
    pub label: String,
    /// The references.
    pub refs: Vec<RRef<Tracked>>,
    /// Maybe one more.
    pub extra: Option<Box<RRef<Tracked>>>,
}

/// Sums the ids behind every reference of a bundle.
#[remote]
pub async fn bundle_sum(_ctx: CallContext, b: Bundle) -> Result<u64, BoxError> {
    let mut sum = 0;
    for r in b.refs.iter().chain(b.extra.as_deref()) {
        sum += r.to_here().await?.id;
    }
    Ok(sum)
}

/// References kept on one worker, by key (an agent extension: in-process groups of tests
/// running at the same time use the same worker names, and must not see each other's).
#[derive(Default)]
struct Kept(Mutex<HashMap<u64, RRef<Tracked>>>);

fn kept(ctx: &CallContext) -> std::sync::Arc<Kept> {
    ctx.agent().extension(Kept::default)
}

/// Keeps a reference on this worker under `key` (so its fork stays alive here).
#[remote]
pub async fn keep(ctx: CallContext, key: u64, r: RRef<Tracked>) -> Result<bool, BoxError> {
    let confirmed = r.confirmed_by_owner();
    let old = kept(&ctx).0.lock().unwrap().insert(key, r);
    drop(old);
    Ok(confirmed)
}

/// Returns (a clone of) the reference kept under `key`: a reference in a result.
#[remote]
pub async fn give(ctx: CallContext, key: u64) -> Result<Option<RRef<Tracked>>, BoxError> {
    Ok(kept(&ctx).0.lock().unwrap().get(&key).cloned())
}

/// Drops the reference kept under `key`.
#[remote]
pub async fn release(ctx: CallContext, key: u64) -> Result<bool, BoxError> {
    let r = kept(&ctx).0.lock().unwrap().remove(&key);
    Ok(r.is_some())
}

/// Drops every reference kept on this worker.
#[remote]
pub async fn release_all(ctx: CallContext) -> Result<usize, BoxError> {
    let dropped: Vec<_> = kept(&ctx).0.lock().unwrap().drain().collect();
    Ok(dropped.len())
}

/// This worker's RRef counters.
#[remote]
pub async fn rref_debug(ctx: CallContext) -> Result<(usize, usize, usize, usize, usize), BoxError> {
    let d = rref::debug_info(ctx.agent());
    Ok((
        d.owner_values,
        d.user_refs,
        d.pending_children,
        d.pending_confirmations,
        d.messages_in_flight,
    ))
}

/// The registry of a worker in the RRef tests.
pub fn registry() -> rpc_core::Registry {
    register(rpc_core::Registry::builder()).build()
}

/// [`live`] as the callee sees it when the call runs.
#[remote]
pub async fn live_now(_ctx: CallContext, ns: u64) -> Result<i64, BoxError> {
    Ok(live(ns))
}

/// What became of the [`sleep_with`] calls under `key`: (started, stopped before finishing).
pub fn sleeper(key: u64) -> (bool, bool) {
    sleepers()
        .lock()
        .unwrap()
        .get(&key)
        .copied()
        .unwrap_or_default()
}

fn sleepers() -> &'static Mutex<HashMap<u64, (bool, bool)>> {
    static S: OnceLock<Mutex<HashMap<u64, (bool, bool)>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// Holds `r` for `ms` milliseconds, then returns its id; records under `key` that it started,
/// and whether it was stopped (its future dropped) before finishing.
#[remote]
pub async fn sleep_with(
    _ctx: CallContext,
    key: u64,
    r: RRef<Tracked>,
    ms: u64,
) -> Result<u64, BoxError> {
    struct Stopped(u64, bool);
    impl Drop for Stopped {
        fn drop(&mut self) {
            if !self.1 {
                sleepers().lock().unwrap().entry(self.0).or_default().1 = true;
            }
        }
    }
    sleepers().lock().unwrap().entry(key).or_default().0 = true;
    let mut guard = Stopped(key, false);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    guard.1 = true;
    Ok(r.to_here().await?.id)
}

/// Adds the RRef test functions and the RRef protocol to `b`.
pub fn register(b: rpc_core::RegistryBuilder) -> rpc_core::RegistryBuilder {
    b.register(make)
        .and_then(|b| b.register(make_slow))
        .and_then(|b| b.register(make_fail))
        .and_then(|b| b.register(id_of))
        .and_then(|b| b.register(push))
        .and_then(|b| b.register(combine))
        .and_then(|b| b.register(read_id))
        .and_then(|b| b.register(bundle_sum))
        .and_then(|b| b.register(keep))
        .and_then(|b| b.register(give))
        .and_then(|b| b.register(release))
        .and_then(|b| b.register(release_all))
        .and_then(|b| b.register(rref_debug))
        .and_then(|b| b.register(sleep_with))
        .and_then(|b| b.register(live_now))
        .and_then(rref::install)
        .expect("distinct names")
}

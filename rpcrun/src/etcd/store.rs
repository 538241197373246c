//! The launchers' keys in etcd, and this launcher's lease.
//!
//! Under `/rpcrun/<JOB>/`:
//!
//! - `job/gen`: the current round's number; `job/base`: the round this run began with (the
//!   restart count is `gen - base`); `job/run`: a token drawn when the run began, so that a
//!   run on a fresh etcd (its data gone, `gen` from 0 again) is told from an earlier one
//!   (TR-7); `job/done`: the job's exit status, once it ended;
//! - `round/<gen>/join/<id>`: a launcher that wants to take part in round `gen`, its value
//!   the address its node would serve the group's rendezvous on; held by the launcher's
//!   lease, so it goes when the launcher does (killed, frozen or cut off from etcd longer
//!   than the lease's TTL);
//! - `round/<gen>/members`: the round's nodes in order (node rank = line), written once, by a
//!   transaction, by whichever launcher first sees enough of them joined;
//! - `round/<gen>/ok/<node rank>`: that node's processes all exited 0 in this round.
//! - `round/<gen>/sink`: where node 0 of the round takes the other nodes' trace parts (TR-9),
//!   written by it when the job is traced.
//!
//! Every change that more than one launcher may try (the first generation, the next round,
//! the members, the end) is a transaction on the key's current value or revision, so exactly
//! one wins; nothing here is consensus of our own.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp,
};

use super::Spec;

/// The lease's time to live: a launcher that stops renewing it (killed, frozen, cut off) leaves
/// every round it joined this long after.
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(5);

/// The bound on each request to etcd.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// What the job's keys say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct JobState {
    /// The current round (`None`: no launcher has run this job yet).
    pub gen: Option<u64>,
    /// The round this run began with.
    pub base: u64,
    /// The token drawn when this run began ("" for a job an older launcher created).
    pub run: String,
    /// The job's exit status, once it ended.
    pub done: Option<i32>,
}

/// A token for a run that begins now: this process and the time in nanoseconds, in hex.
fn run_token() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("{:x}-{nanos:x}", std::process::id())
}

/// A launcher that joined a round: its id and its node's rendezvous address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Joiner {
    pub id: String,
    pub addr: String,
}

/// This launcher's connection to etcd and its lease (renewed by a task of the store's
/// runtime; `lost` says why it stopped).
pub(crate) struct Store {
    rt: tokio::runtime::Runtime,
    client: Client,
    prefix: String,
    endpoints: String,
    lease: i64,
    lost: Arc<Mutex<Option<String>>>,
}

/// An error from etcd, naming the endpoints.
pub(crate) type Result<T> = std::result::Result<T, String>;

impl Store {
    /// Connects to the spec's endpoints and takes a lease.
    pub(crate) fn connect(spec: &Spec) -> Result<Self> {
        let endpoints = spec.endpoints.join(",");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| format!("starting a runtime for etcd: {e}"))?;
        let urls: Vec<String> = spec
            .endpoints
            .iter()
            .map(|e| format!("http://{e}"))
            .collect();
        let options = ConnectOptions::new()
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT);
        let client = rt
            .block_on(async {
                tokio::time::timeout(REQUEST_TIMEOUT, Client::connect(urls, Some(options))).await
            })
            .map_err(|_| format!("etcd at {endpoints}: no connection within 5 s"))?
            .map_err(|e| format!("etcd at {endpoints}: {e}"))?;
        let mut store = Self {
            rt,
            client,
            prefix: format!("/rpcrun/{}/", spec.job),
            endpoints,
            lease: 0,
            lost: Arc::new(Mutex::new(None)),
        };
        store.renew_lease()?;
        Ok(store)
    }

    /// Takes a fresh lease (the first, or after the last one was lost) and keeps it alive.
    pub(crate) fn renew_lease(&mut self) -> Result<()> {
        let mut c = self.client.clone();
        let ttl = LEASE_TTL.as_secs() as i64;
        let lease = self
            .call(async move { c.lease_grant(ttl, None).await })?
            .id();
        let client = self.client.clone();
        let lost = Arc::new(Mutex::new(None));
        let flag = Arc::clone(&lost);
        self.rt.spawn(async move {
            let why = keep_alive(client, lease).await;
            *flag.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
        });
        self.lease = lease;
        self.lost = lost;
        Ok(())
    }

    /// Why this launcher's lease is lost, if it is: its keys are gone, or soon will be.
    pub(crate) fn lease_lost(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Gives the lease back (its keys go at once): on the launcher's exit.
    pub(crate) fn leave(&self) {
        let mut c = self.client.clone();
        let lease = self.lease;
        let _ = self.call(async move { c.lease_revoke(lease).await });
    }

    fn key(&self, rest: &str) -> String {
        format!("{}{rest}", self.prefix)
    }

    /// Runs one request with the bound, naming etcd in its error.
    fn call<T, F>(&self, f: F) -> Result<T>
    where
        F: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        match self
            .rt
            .block_on(async { tokio::time::timeout(REQUEST_TIMEOUT, f).await })
        {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("etcd at {}: {e}", self.endpoints)),
            Err(_) => Err(format!(
                "etcd at {}: no answer within {REQUEST_TIMEOUT:?}",
                self.endpoints
            )),
        }
    }

    /// The job's state.
    pub(crate) fn state(&self) -> Result<JobState> {
        let mut c = self.client.clone();
        let prefix = self.key("job/");
        let r = self.call(async move {
            c.get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                .await
        })?;
        let mut s = JobState::default();
        for kv in r.kvs() {
            let k = kv.key_str().unwrap_or_default();
            let v = kv.value_str().unwrap_or_default();
            match k.rsplit('/').next() {
                Some("gen") => s.gen = v.parse().ok(),
                Some("base") => s.base = v.parse().unwrap_or(0),
                Some("run") => s.run = v.to_owned(),
                Some("done") => s.done = v.parse().ok(),
                _ => {}
            }
        }
        Ok(s)
    }

    /// Runs `then` if `when` holds; whether it did.
    fn txn(&self, when: Vec<Compare>, then: Vec<TxnOp>) -> Result<bool> {
        let mut c = self.client.clone();
        let t = Txn::new().when(when).and_then(then);
        Ok(self.call(async move { c.txn(t).await })?.succeeded())
    }

    /// Creates the job's keys at round 0 unless they exist.
    pub(crate) fn create_job(&self) -> Result<bool> {
        let gen = self.key("job/gen");
        self.txn(
            vec![Compare::create_revision(gen.as_str(), CompareOp::Equal, 0)],
            vec![
                TxnOp::put(gen.as_str(), "0", None),
                TxnOp::put(self.key("job/base"), "0", None),
                TxnOp::put(self.key("job/run"), run_token(), None),
            ],
        )
    }

    /// Starts a new run of the job after round `gen` (the last run ended, or every launcher of
    /// its round is gone): round `gen + 1`, restarts counted from it, no exit status.
    pub(crate) fn new_run(&self, gen: u64) -> Result<bool> {
        let next = (gen + 1).to_string();
        self.txn(
            vec![Compare::value(
                self.key("job/gen"),
                CompareOp::Equal,
                gen.to_string(),
            )],
            vec![
                TxnOp::put(self.key("job/gen"), next.as_str(), None),
                TxnOp::put(self.key("job/base"), next.as_str(), None),
                TxnOp::put(self.key("job/run"), run_token(), None),
                TxnOp::delete(self.key("job/done"), None),
            ],
        )
    }

    /// Ends round `gen` for everyone: the next round begins (unless someone did it first).
    pub(crate) fn next_round(&self, gen: u64) -> Result<bool> {
        self.txn(
            vec![Compare::value(
                self.key("job/gen"),
                CompareOp::Equal,
                gen.to_string(),
            )],
            vec![TxnOp::put(self.key("job/gen"), (gen + 1).to_string(), None)],
        )
    }

    /// Ends the job with `code` (the first to say so wins).
    pub(crate) fn finish(&self, code: i32) -> Result<bool> {
        let done = self.key("job/done");
        self.txn(
            vec![Compare::create_revision(done.as_str(), CompareOp::Equal, 0)],
            vec![TxnOp::put(done.as_str(), code.to_string(), None)],
        )
    }

    /// Joins round `gen` as `id`, offering `addr` for the rendezvous; held by the lease.
    pub(crate) fn join(&self, gen: u64, id: &str, addr: &str) -> Result<()> {
        let mut c = self.client.clone();
        let key = self.key(&format!("round/{gen}/join/{id}"));
        let addr = addr.to_owned();
        let opts = PutOptions::new().with_lease(self.lease);
        self.call(async move { c.put(key, addr, Some(opts)).await })
            .map(|_| ())
    }

    /// Who joined round `gen` (and still holds a lease), in the order they joined.
    pub(crate) fn joined(&self, gen: u64) -> Result<Vec<Joiner>> {
        let mut c = self.client.clone();
        let prefix = self.key(&format!("round/{gen}/join/"));
        let opts = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let p = prefix.clone();
        let r = self.call(async move { c.get(p, Some(opts)).await })?;
        Ok(r.kvs()
            .iter()
            .map(|kv| Joiner {
                id: kv.key_str().unwrap_or_default()[prefix.len()..].to_owned(),
                addr: kv.value_str().unwrap_or_default().to_owned(),
            })
            .collect())
    }

    /// Round `gen`'s members, once formed.
    pub(crate) fn members(&self, gen: u64) -> Result<Option<Vec<Joiner>>> {
        let mut c = self.client.clone();
        let key = self.key(&format!("round/{gen}/members"));
        let r = self.call(async move { c.get(key, None).await })?;
        Ok(r.kvs().first().map(|kv| {
            kv.value_str()
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.split_once(' '))
                .map(|(id, addr)| Joiner {
                    id: id.to_owned(),
                    addr: addr.to_owned(),
                })
                .collect()
        }))
    }

    /// Forms round `gen` with `members` unless it was formed already.
    pub(crate) fn form(&self, gen: u64, members: &[Joiner]) -> Result<bool> {
        let key = self.key(&format!("round/{gen}/members"));
        let text: String = members
            .iter()
            .map(|j| format!("{} {}\n", j.id, j.addr))
            .collect();
        self.txn(
            vec![Compare::create_revision(key.as_str(), CompareOp::Equal, 0)],
            vec![TxnOp::put(key.as_str(), text, None)],
        )
    }

    /// Says where node 0 of round `gen` takes the other nodes' trace parts (TR-9).
    pub(crate) fn set_sink(&self, gen: u64, addr: &str) -> Result<()> {
        let mut c = self.client.clone();
        let key = self.key(&format!("round/{gen}/sink"));
        let addr = addr.to_owned();
        self.call(async move { c.put(key, addr, None).await })
            .map(|_| ())
    }

    /// Where node 0 of round `gen` takes the other nodes' trace parts, if it said.
    pub(crate) fn sink(&self, gen: u64) -> Result<Option<String>> {
        let mut c = self.client.clone();
        let key = self.key(&format!("round/{gen}/sink"));
        let r = self.call(async move { c.get(key, None).await })?;
        Ok(r.kvs()
            .first()
            .and_then(|kv| kv.value_str().ok())
            .map(str::to_owned))
    }

    /// Says node `node_rank`'s processes all succeeded in round `gen`.
    pub(crate) fn succeeded(&self, gen: u64, node_rank: u32) -> Result<()> {
        let mut c = self.client.clone();
        let key = self.key(&format!("round/{gen}/ok/{node_rank}"));
        self.call(async move { c.put(key, "0", None).await })
            .map(|_| ())
    }

    /// The node ranks that said so in round `gen`.
    pub(crate) fn succeeded_nodes(&self, gen: u64) -> Result<Vec<u32>> {
        let mut c = self.client.clone();
        let prefix = self.key(&format!("round/{gen}/ok/"));
        let p = prefix.clone();
        let opts = GetOptions::new().with_prefix();
        let r = self.call(async move { c.get(p, Some(opts)).await })?;
        Ok(r.kvs()
            .iter()
            .filter_map(|kv| kv.key_str().ok()?[prefix.len()..].parse().ok())
            .collect())
    }
}

/// Renews `lease` until it is lost; says why. A renewal that fails is tried again (on a new
/// stream) until [`LEASE_TTL`] has passed since the last one that succeeded: only then may
/// etcd have let the lease go, and the launcher must stop its processes (ETC-2); an etcd that
/// is down for less (a restart, a new leader) costs nothing.
async fn keep_alive(mut client: Client, lease: i64) -> String {
    let mut last_ok = tokio::time::Instant::now();
    let mut streams = None;
    loop {
        tokio::time::sleep(LEASE_TTL / 5).await;
        if streams.is_none() {
            match tokio::time::timeout(REQUEST_TIMEOUT, client.lease_keep_alive(lease)).await {
                Ok(Ok(s)) => streams = Some(s),
                Ok(Err(e)) if last_ok.elapsed() >= LEASE_TTL => {
                    return format!("not renewed for {LEASE_TTL:?}: {e}")
                }
                Err(_) if last_ok.elapsed() >= LEASE_TTL => {
                    return format!("not renewed for {LEASE_TTL:?}: etcd does not answer")
                }
                _ => continue,
            }
        }
        let (keeper, stream) = streams.as_mut().expect("set above");
        let renewed = async {
            keeper.keep_alive().await?;
            stream.message().await
        };
        match tokio::time::timeout(LEASE_TTL / 2, renewed).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => last_ok = tokio::time::Instant::now(),
            Ok(Ok(Some(_))) => return "etcd says it expired".to_owned(),
            outcome => {
                streams = None;
                if last_ok.elapsed() >= LEASE_TTL {
                    let e = match outcome {
                        Ok(Err(e)) => e.to_string(),
                        Ok(Ok(None)) => "etcd closed the renewal stream".to_owned(),
                        _ => "etcd does not answer".to_owned(),
                    };
                    return format!("not renewed for {LEASE_TTL:?}: {e}");
                }
            }
        }
    }
}

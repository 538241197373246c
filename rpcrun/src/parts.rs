//! The job's trace across nodes: node 0's launcher takes the other nodes' parts however the
//! job ended, and merges (TR-9; `rpc_core::trace::PartSink`).
//!
//! Node 0's launcher (with etcd: a launcher the first time it is node 0 of a round) listens
//! on a sink for the rest of its run and names it to its processes; every other node's
//! launcher, once its processes have ended, sends the parts it finds to the sink they name.
//! The launcher that merges (node 0's; with etcd, node 0's of the last round) first waits, at
//! most [`SINK_WAIT`], for every other node of the job to have sent its parts, and closes
//! its sink before it merges.

use std::path::Path;
use std::time::Duration;

use rpc_core::trace::{MergeSummary, PartSink, TRACE_SINK_ENV};
use rpc_core::Secret;

use crate::{Launch, LaunchError};

/// How long the launcher that merges waits for the other nodes' parts once its own processes
/// have ended: the other nodes' processes end within seconds of its own (their group has
/// failed, or finished), and each node says when it has nothing to send (TR-11).
pub(crate) const SINK_WAIT: Duration = Duration::from_secs(15);

/// How long a node's launcher keeps trying to reach node 0's sink.
const SEND_BOUND: Duration = Duration::from_secs(10);

/// A launch's side of the exchange: the group's secret and, once this launcher has been
/// node 0, its sink.
pub(crate) struct Parts {
    secret: Secret,
    sink: Option<(PartSink, String)>,
}

impl Parts {
    /// For a traced launch on several nodes; `None` otherwise (nothing to exchange).
    pub(crate) fn new(launch: &Launch, trace: Option<&Path>) -> Result<Option<Self>, LaunchError> {
        if trace.is_none() || launch.nnodes < 2 {
            return Ok(None);
        }
        let file = crate::secret::SecretFile::resolve(launch)?;
        let secret = Secret::from_file(file.path()).map_err(|e| LaunchError::Secret {
            path: file.path().display().to_string(),
            source: std::io::Error::other(e.to_string()),
        })?;
        Ok(Some(Parts { secret, sink: None }))
    }

    /// As node 0, reached by the others at `host`: listens (once per run) and names the sink
    /// to this node's processes, through `env`; returns its address.
    pub(crate) fn serve(
        &mut self,
        host: &str,
        trace: &Path,
        env: &mut Vec<(String, String)>,
    ) -> Result<String, LaunchError> {
        if self.sink.is_none() {
            let loopback = host == "localhost"
                || (host.trim_matches(['[', ']']).parse::<std::net::IpAddr>())
                    .is_ok_and(|ip| ip.is_loopback());
            let bind = if loopback {
                format!("{host}:0")
            } else {
                "0.0.0.0:0".to_owned()
            };
            let sink = PartSink::start(&bind, self.secret.clone(), trace).map_err(|source| {
                LaunchError::System {
                    what: "listening for the other nodes' trace parts",
                    source,
                }
            })?;
            let addr = format!("{host}:{}", sink.local_addr().port());
            self.sink = Some((sink, addr));
        }
        let (_, addr) = self.sink.as_ref().expect("listening");
        env.push((TRACE_SINK_ENV.to_owned(), addr.clone()));
        Ok(addr.clone())
    }

    /// At the end of the launch: the launcher that merges (`merges`) waits for the `others`
    /// nodes' parts; every other sends its own to node 0, as `from`: to `sink` where it is
    /// known (with etcd, from the round; else as a child said on its status pipe, TR-11),
    /// then a node without parts says so too; else to the sink its parts name.
    pub(crate) fn exchange(
        &mut self,
        trace: &Path,
        merges: bool,
        others: usize,
        sink: Option<&str>,
        from: &str,
    ) {
        if !merges {
            match rpc_core::trace::send_parts(trace, sink, from, &self.secret, SEND_BOUND) {
                Ok(s) => eprintln!(
                    "rpcrun: this node's trace parts sent to node 0 ({}: {} written{})",
                    s.sink,
                    s.written,
                    match s.refused {
                        0 => String::new(),
                        n => format!(", {n} refused"),
                    }
                ),
                Err(e) => eprintln!("rpcrun: this node's trace parts not sent to node 0: {e}"),
            }
            return;
        }
        let Some((sink, _)) = self.sink.take() else {
            return;
        };
        let heard = sink.wait_for(others, SINK_WAIT);
        // Closed before the merge: a part replaced while it is merged would fail the merge.
        drop(sink);
        if heard.len() < others {
            eprintln!(
                "rpcrun: {} of the {others} other nodes sent their trace parts within {} s \
                 ({}); the merge goes on without the rest",
                heard.len(),
                SINK_WAIT.as_secs(),
                if heard.is_empty() {
                    "none".to_owned()
                } else {
                    heard.join(", ")
                }
            );
        }
    }
}

/// On node 0 (`merges`), merges the job's trace at `trace` from its parts, saying how it
/// went: the summary, if the trace was written. Elsewhere, says where this node's parts are.
pub(crate) fn merge_trace(trace: &Path, merges: bool) -> Option<MergeSummary> {
    if !merges {
        eprintln!(
            "rpcrun: this node's trace parts are in {}; node 0 merges the trace",
            rpc_core::trace::parts_dir(trace).display()
        );
        return None;
    }
    match rpc_core::trace::merge_parts(trace, None) {
        Ok(s) => {
            eprintln!("rpcrun: trace {}: {s}", trace.display());
            Some(s)
        }
        Err(e) => {
            eprintln!("rpcrun: trace not written: {e}");
            None
        }
    }
}

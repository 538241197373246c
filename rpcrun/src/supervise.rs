//! The launch loop: start every process, watch them, stop them all on the first failure or a
//! signal, and start them again while restarts are left.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::child::{self, Child};
use crate::env::{child_env, Rendezvous};
use crate::secret::SecretFile;
use crate::{Exit, Failure, Launch, LaunchError};

/// How often children are checked.
const POLL: Duration = Duration::from_millis(10);

/// Signals forwarded to the children.
const FORWARDED: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// How one attempt ended.
enum Ended {
    /// Every child exited with status 0.
    Success,
    /// A child failed; the others were stopped.
    Failed(Failure),
    /// The launcher got this signal; it was forwarded and every child stopped.
    Signalled(i32),
}

/// The launcher's signal handlers, removed on drop.
struct Handlers {
    got: Arc<AtomicUsize>,
    ids: Vec<signal_hook::SigId>,
}

impl Handlers {
    fn install() -> Result<Self, LaunchError> {
        let got = Arc::new(AtomicUsize::new(0));
        let mut ids = Vec::new();
        for s in FORWARDED {
            let id = signal_hook::flag::register_usize(s, Arc::clone(&got), s as usize).map_err(
                |source| LaunchError::System {
                    what: "installing signal handlers",
                    source,
                },
            )?;
            ids.push(id);
        }
        Ok(Self { got, ids })
    }

    /// The signal received, if any.
    fn received(&self) -> Option<i32> {
        match self.got.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s as i32),
        }
    }
}

impl Drop for Handlers {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

pub(crate) fn run(launch: &Launch) -> Result<Exit, LaunchError> {
    let secret = SecretFile::resolve(launch)?;
    let handlers = Handlers::install()?;
    let mut failures = Vec::new();
    let mut attempt = 0;
    loop {
        let rdzv = rendezvous(launch)?;
        tracing::info!(
            attempt,
            nproc = launch.nproc,
            world_size = launch.world_size(),
            master = %format!("{}:{}", rdzv.host, rdzv.port),
            "starting {} processes", launch.nproc
        );
        let ended = run_attempt(launch, attempt, &rdzv, secret.path(), &handlers)?;
        let code = match ended {
            Ended::Success => 0,
            Ended::Signalled(s) => {
                tracing::warn!("stopped every process on {}", child::signal_name(s));
                128 + s
            }
            Ended::Failed(f) => {
                let code = f.code;
                failures.push(f);
                if attempt >= launch.max_restarts {
                    if launch.max_restarts > 0 {
                        tracing::warn!(
                            "out of restarts ({} used); exiting with the last failure's status {code}",
                            launch.max_restarts
                        );
                    }
                    code
                } else {
                    attempt += 1;
                    tracing::warn!(
                        "restarting all {} processes (restart {attempt} of {})",
                        launch.nproc,
                        launch.max_restarts
                    );
                    continue;
                }
            }
        };
        return Ok(Exit {
            code,
            restarts: attempt,
            failures,
        });
    }
}

/// Where the group meets in this attempt: the given address, else a port of 127.0.0.1 free now.
fn rendezvous(launch: &Launch) -> Result<Rendezvous, LaunchError> {
    if let Some(hp) = &launch.rdzv {
        let (host, port) = hp.rsplit_once(':').expect("validated");
        return Ok(Rendezvous {
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            port: port.parse().expect("validated"),
        });
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|source| LaunchError::System {
            what: "finding a free port for the rendezvous",
            source,
        })?
        .port();
    Ok(Rendezvous {
        host: "127.0.0.1".into(),
        port,
    })
}

fn run_attempt(
    launch: &Launch,
    attempt: u32,
    rdzv: &Rendezvous,
    secret: &std::path::Path,
    handlers: &Handlers,
) -> Result<Ended, LaunchError> {
    let mut children: Vec<Child> = Vec::new();
    for local in 0..launch.nproc {
        let env = child_env(launch, local, attempt, rdzv, Some(secret));
        let rank = launch.node_rank * launch.nproc + local;
        match Child::spawn(launch, rank, &env) {
            Ok(c) => children.push(c),
            Err(e) => {
                child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
                return Err(e);
            }
        }
    }
    loop {
        if let Some(s) = handlers.received() {
            tracing::warn!(
                "got {}; forwarding it to every process",
                child::signal_name(s)
            );
            child::stop_all(&mut children, s, launch.stop_grace);
            return Ok(Ended::Signalled(s));
        }
        let mut running = 0;
        for c in &mut children {
            match c.try_wait() {
                None => running += 1,
                Some(st) if st.success() => {}
                Some(st) => {
                    let (code, what) = child::describe(st);
                    tracing::warn!("rank {} (pid {}) {what}", c.rank, c.pid());
                    let failure = Failure {
                        attempt,
                        rank: c.rank,
                        code,
                        what,
                    };
                    child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
                    return Ok(Ended::Failed(failure));
                }
            }
        }
        if running == 0 {
            child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
            return Ok(Ended::Success);
        }
        std::thread::sleep(POLL);
    }
}

//! A [`Config`] resolved: every field the program left unset taken from the environment (the
//! variables of `env.rs`) or its default, every value checked, and the result split by who
//! uses it ([`Resolved`]). One small function per decision; each error names the setting or
//! the variable and what was wrong with it.

use std::time::Duration;

use super::env::{
    env_number, Env, FAILURE_TIMEOUT_ENV, HEARTBEAT_INTERVAL_ENV, JOB_ID_ENV, MASTER_ADDR_ENV,
    MASTER_PORT_ENV, MAX_WORLD_SIZE_ENV, RANK_ENV, REPLACE_TOKEN_ENV, RESTART_COUNT_ENV,
    RESTART_MODE_ENV, SERVE_RENDEZVOUS_ENV, SIGNAL_GRACE_ENV, TORCHRUN_AGENT_STORE_ENV,
    WIRE_PROTECTION_ENV, WORLD_SIZE_ENV,
};
use super::{Config, RENDEZVOUS_FD_ENV};
use crate::error::InitError;
use crate::net::{NetConfig, Secret, Transport, WireProtection, SECRET_ENV, SECRET_FILE_ENV};
use crate::rendezvous::GroupSize;
use crate::trace::TRACE_ENV;

/// The shortest group secret init accepts: a shorter one is guessable.
const MIN_SECRET_BYTES: usize = 16;

/// A configuration with every default and environment variable applied, split by who uses
/// it: group formation, the caller and callee, and the network layer ([`NetConfig`], which
/// holds the rank, world size, secret and transport).
#[derive(Clone, Debug)]
pub(crate) struct Resolved {
    /// The group's size as this worker says it at the rendezvous.
    pub size: GroupSize,
    pub name: String,
    /// `host:port` of the rendezvous.
    pub rendezvous: String,
    pub serve_rendezvous: bool,
    /// The socket the rendezvous it serves listens on, when one was handed over (RDV-8).
    pub rendezvous_listener: Option<std::sync::Arc<std::net::TcpListener>>,
    /// It replaces the holder of its rank (see [`Config::replace`]).
    pub replace: bool,
    /// The token its launcher handed it for that ([`REPLACE_TOKEN_ENV`]).
    pub replace_token: Option<String>,
    /// A launcher replaces failed processes one by one (see [`Config::replaced_on_failure`]).
    pub replaced_on_failure: bool,
    /// The launcher's restart count ([`RESTART_COUNT_ENV`]; 0 on the first start), for the
    /// trace's parts.
    pub restart_count: u64,
    /// The launcher's name for the job ([`JOB_ID_ENV`]), for the trace's parts.
    pub job_id: Option<String>,
    /// Node 0's launcher's sink for trace parts ([`crate::trace::TRACE_SINK_ENV`]), for the
    /// rendezvous this worker serves and its own part (TR-9).
    pub trace_sink: Option<String>,
    pub listen_addr: String,
    pub init_timeout: Duration,
    pub rpc_timeout: Duration,
    pub shutdown_timeout: Duration,
    pub max_concurrent_calls: usize,
    pub sync_connections: bool,
    /// See [`Config::signal_grace`].
    pub signal_grace: Option<Duration>,
    /// See [`Config::trace`].
    pub tracer: crate::trace::Tracer,
    pub net: NetConfig,
}

fn config_error(msg: impl Into<String>) -> InitError {
    InitError::Config(msg.into())
}

impl Config {
    pub(crate) fn resolve(self) -> Result<Resolved, InitError> {
        self.resolve_with(&|k| std::env::var(k).ok())
    }

    /// [`Config::resolve`] with `env` as the environment (tests give their own).
    pub(crate) fn resolve_with(self, env: Env<'_>) -> Result<Resolved, InitError> {
        let (rank, size) = self.rank_and_size(env)?;
        let rendezvous = self.rendezvous(env)?;
        let secret = self.secret(env)?;
        let listen_addr = self.listen_addr(&rendezvous);
        self.check_limits()?;
        let (heartbeat_interval, failure_timeout) = self.liveness(env)?;
        let serve_rendezvous = self.serves_rendezvous(env, rank)?;
        let rendezvous_listener = match serve_rendezvous {
            true => self.handed_listener(env, &rendezvous)?,
            false => None,
        };
        let (replace, replaced_on_failure) = self.restarts(env)?;
        let restart_count = env_number(env, &RESTART_COUNT_ENV, "restart count")?.unwrap_or(0);
        let protection = self.protection(env)?;
        let signal_grace = match self.signal_grace {
            Some(g) => Some(g),
            None => env(SIGNAL_GRACE_ENV)
                .map(|v| {
                    v.trim()
                        .parse::<u64>()
                        .map(Duration::from_millis)
                        .map_err(|_| {
                            config_error(format!(
                                "{SIGNAL_GRACE_ENV}={v:?} is not a number of milliseconds"
                            ))
                        })
                })
                .transpose()?,
        };
        let tracer = crate::trace::from_config(self.trace, env(TRACE_ENV), self.trace_capacity)
            .map_err(|e| config_error(format!("trace: {e}")))?;
        Ok(Resolved {
            tracer,
            size,
            name: self.name.unwrap_or_else(|| format!("worker{rank}")),
            serve_rendezvous,
            rendezvous_listener,
            replace,
            replace_token: self
                .replace_token
                .or_else(|| env(REPLACE_TOKEN_ENV))
                .filter(|t| replace && !t.is_empty()),
            replaced_on_failure,
            restart_count: u64::from(restart_count),
            // torchrun's `--rdzv-id` is "none" unless given: the same for every job, so no name.
            job_id: JOB_ID_ENV
                .iter()
                .find_map(|k| env(k).filter(|v| !v.trim().is_empty() && v != "none")),
            trace_sink: env(crate::trace::TRACE_SINK_ENV).filter(|v| !v.trim().is_empty()),
            rendezvous,
            listen_addr,
            init_timeout: self.init_timeout,
            rpc_timeout: self.rpc_timeout,
            shutdown_timeout: self.shutdown_timeout,
            max_concurrent_calls: self.max_concurrent_calls,
            sync_connections: self.sync_connections,
            signal_grace,
            net: NetConfig {
                transport: self.transport,
                secret,
                protection,
                rank,
                incarnation: 0,
                capacity: size.capacity(),
                connect_timeout: self.connect_timeout,
                handshake_timeout: self.handshake_timeout,
                max_frame_bytes: self.max_frame_bytes,
                max_blob_bytes: self.max_blob_bytes,
                max_queued_bytes: self.max_queued_bytes,
                max_in_flight: (self.max_in_flight_calls, self.max_in_flight_bytes),
                bulk_threshold: self.bulk_threshold,
                bulk_pool_bytes: self.bulk_pool_bytes,
                shm_arena_bytes: self.shm_arena_bytes,
                busy_poll: self.busy_poll,
                max_sync_connections: self.max_sync_connections,
                heartbeat_interval,
                failure_timeout,
            },
        })
    }

    /// The rank and the group's size (fixed, growing or dynamic), the rank within it.
    fn rank_and_size(&self, env: Env<'_>) -> Result<(u32, GroupSize), InitError> {
        let rank = match self.rank {
            Some(r) => r,
            None => env_number(env, &RANK_ENV, "rank")?.ok_or_else(|| {
                config_error(format!("no rank: set Config::rank or one of {RANK_ENV:?}"))
            })?,
        };
        let world_size = match self.world_size {
            Some(w) => Some(w),
            None => env_number(env, &WORLD_SIZE_ENV, "world size")?,
        };
        let max_world_size = match self.max_world_size {
            Some(m) => Some(m),
            None => env_number(env, &[MAX_WORLD_SIZE_ENV], "maximum world size")?,
        };
        let size = match (world_size, max_world_size) {
            (Some(0), _) => return Err(config_error("world size 0")),
            (Some(w), m) => GroupSize::growing(w, m.unwrap_or(w)),
            (None, Some(m)) => GroupSize::dynamic(m),
            (None, None) => {
                return Err(config_error(format!(
                    "no world size: set Config::world_size or one of {WORLD_SIZE_ENV:?} (or \
                     only Config::max_world_size or {MAX_WORLD_SIZE_ENV} for a dynamic group)"
                )))
            }
        };
        size.check().map_err(InitError::Config)?;
        if rank >= size.capacity() {
            return Err(config_error(format!("rank {rank} is outside {size}")));
        }
        Ok((rank, size))
    }

    /// The rendezvous's `host:port`: `init_method`, else `MASTER_ADDR` and `MASTER_PORT` (the
    /// next port under torchrun, whose own store listens at `MASTER_PORT`).
    fn rendezvous(&self, env: Env<'_>) -> Result<String, InitError> {
        let addr = match &self.init_method {
            Some(m) => m
                .strip_prefix("tcp://")
                .ok_or_else(|| {
                    config_error(format!("init method {m:?} must look like tcp://host:port"))
                })?
                .to_owned(),
            None => match (env(MASTER_ADDR_ENV), env(MASTER_PORT_ENV)) {
                (Some(a), Some(p)) if env(TORCHRUN_AGENT_STORE_ENV).as_deref() == Some("True") => {
                    let port: u16 = p.trim().parse().map_err(|_| {
                        config_error(format!("{MASTER_PORT_ENV}={p:?} is not a port"))
                    })?;
                    let next = port.checked_add(1).ok_or_else(|| {
                        config_error(format!(
                            "{MASTER_PORT_ENV}={port} under torchrun leaves no next port for the \
                             rendezvous"
                        ))
                    })?;
                    format!("{a}:{next}")
                }
                (Some(a), Some(p)) => format!("{a}:{p}"),
                _ => {
                    return Err(config_error(format!(
                        "no rendezvous: set Config::init_method (tcp://host:port) or \
                         {MASTER_ADDR_ENV} and {MASTER_PORT_ENV}"
                    )))
                }
            },
        };
        if addr
            .rsplit_once(':')
            .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        {
            return Err(config_error(format!(
                "rendezvous address {addr:?} is not host:port"
            )));
        }
        Ok(addr)
    }

    /// The group secret: `Config::secret`, else the environment's; at least 16 bytes.
    fn secret(&self, env: Env<'_>) -> Result<Secret, InitError> {
        let secret = match &self.secret {
            Some(s) => s.clone(),
            None => Secret::from_env_with(env)?.ok_or(InitError::MissingSecret {
                env: SECRET_ENV,
                file_env: SECRET_FILE_ENV,
            })?,
        };
        if secret.len() < MIN_SECRET_BYTES {
            return Err(config_error(format!(
                "the group secret is {} bytes; at least {MIN_SECRET_BYTES} are required \
                 (Secret::generate makes 64 random hex digits)",
                secret.len()
            )));
        }
        Ok(secret)
    }

    /// Where to listen: `listen_addr`, else an ephemeral port on loopback when the
    /// rendezvous is on loopback, on every interface otherwise.
    fn listen_addr(&self, rendezvous: &str) -> String {
        if let Some(a) = &self.listen_addr {
            return a.clone();
        }
        let host = rendezvous.rsplit_once(':').map_or("", |(h, _)| h);
        match &self.transport {
            Transport::Memory(_) => "mem:0".to_owned(),
            Transport::Tcp if is_loopback(host) => "127.0.0.1:0".to_owned(),
            Transport::Tcp => "0.0.0.0:0".to_owned(),
        }
    }

    fn check_limits(&self) -> Result<(), InitError> {
        if self.max_frame_bytes < 1024 {
            return Err(config_error("max_frame_bytes must be at least 1024"));
        }
        if self.max_concurrent_calls == 0 {
            return Err(config_error("max_concurrent_calls must be positive"));
        }
        if self.max_in_flight_calls == 0 {
            return Err(config_error("max_in_flight_calls must be positive"));
        }
        if self.trace_capacity == 0 {
            // A ring of none kept one event and counted every other as dropped.
            return Err(config_error(
                "trace_capacity must be positive (leave the trace off to record nothing)",
            ));
        }
        Ok(())
    }

    /// The failure detector's heartbeat interval and failure timeout.
    fn liveness(&self, env: Env<'_>) -> Result<(Duration, Duration), InitError> {
        let millis = |key: &str, given: Option<Duration>, default: Duration| {
            if let Some(d) = given {
                return Ok(d);
            }
            match env(key) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse::<u64>()
                    .map(Duration::from_millis)
                    .map_err(|_| {
                        config_error(format!("{key}={v:?} is not a number of milliseconds"))
                    }),
            }
        };
        let heartbeat_interval = millis(
            HEARTBEAT_INTERVAL_ENV,
            self.heartbeat_interval,
            Duration::from_millis(250),
        )?;
        let failure_timeout = millis(
            FAILURE_TIMEOUT_ENV,
            self.failure_timeout,
            Duration::from_millis(1500),
        )?;
        if !heartbeat_interval.is_zero() && failure_timeout < heartbeat_interval * 2 {
            return Err(config_error(format!(
                "failure_timeout ({failure_timeout:?}) must be at least twice the heartbeat \
                 interval ({heartbeat_interval:?})"
            )));
        }
        Ok((heartbeat_interval, failure_timeout))
    }

    /// Whether this worker hosts the rendezvous (rank 0 unless told otherwise).
    fn serves_rendezvous(&self, env: Env<'_>, rank: u32) -> Result<bool, InitError> {
        Ok(match (self.serve_rendezvous, env(SERVE_RENDEZVOUS_ENV)) {
            (Some(s), _) => s,
            (None, Some(v)) => match v.trim() {
                "1" | "true" => true,
                "0" | "false" => false,
                other => {
                    return Err(config_error(format!(
                        "{SERVE_RENDEZVOUS_ENV}={other:?}: expected 0 or 1"
                    )))
                }
            },
            (None, None) => rank == 0,
        })
    }

    /// The listener the rendezvous this worker serves takes over (RDV-8): the program's, else
    /// the one its launcher handed it ([`RENDEZVOUS_FD_ENV`]); checked to listen on the
    /// rendezvous's port.
    fn handed_listener(
        &self,
        env: Env<'_>,
        rendezvous: &str,
    ) -> Result<Option<std::sync::Arc<std::net::TcpListener>>, InitError> {
        let listener = match (&self.rendezvous_listener, env(RENDEZVOUS_FD_ENV)) {
            (Some(l), _) => l
                .try_clone()
                .map_err(|e| config_error(format!("cannot copy the rendezvous listener: {e}")))?,
            (None, Some(v)) => crate::rendezvous::handed_listener(&v)?,
            (None, None) => return Ok(None),
        };
        let listener = crate::rendezvous::check_handed(listener, rendezvous)?;
        Ok(Some(std::sync::Arc::new(listener)))
    }

    /// Whether this process replaces a failed holder of its rank, and whether the launcher
    /// replaces failed processes one by one.
    fn restarts(&self, env: Env<'_>) -> Result<(bool, bool), InitError> {
        let replace = match self.replace {
            Some(r) => r,
            None => env_number(env, &RESTART_COUNT_ENV, "restart count")?.unwrap_or(0) > 0,
        };
        let one_by_one = match (self.replaced_on_failure, env(RESTART_MODE_ENV)) {
            (Some(r), _) => r,
            (None, Some(v)) => match v.trim() {
                "worker" => true,
                "group" | "" => false,
                other => {
                    return Err(config_error(format!(
                        "{RESTART_MODE_ENV}={other:?}: expected `worker` or `group`"
                    )))
                }
            },
            (None, None) => false,
        };
        Ok((replace, one_by_one))
    }

    fn protection(&self, env: Env<'_>) -> Result<WireProtection, InitError> {
        Ok(match (self.wire_protection, env(WIRE_PROTECTION_ENV)) {
            (Some(p), _) => p,
            (None, Some(v)) => v
                .parse()
                .map_err(|e| config_error(format!("{WIRE_PROTECTION_ENV}: {e}")))?,
            (None, None) => WireProtection::Auto,
        })
    }
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_matches(|c| c == '[' || c == ']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

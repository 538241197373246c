//! What the network layer is configured with: resolved from [`Config`](crate::Config) once at
//! init and shared by every connection, so no connection reads the user's configuration.

use std::time::Duration;

use super::auth::Secret;
use super::seal::WireProtection;
use super::transport::Transport;

/// The network layer's settings (each documented on the `Config` field it comes from).
#[derive(Clone, Debug)]
pub(crate) struct NetConfig {
    pub transport: Transport,
    pub secret: Secret,
    /// What protects connections' bytes after their handshake.
    pub protection: WireProtection,
    /// This worker's rank, sent in every handshake.
    pub rank: u32,
    /// Which incarnation of the rank this process is (assigned at the rendezvous), sent in
    /// every handshake.
    pub incarnation: u64,
    /// Ranks at or above this are refused at the handshake.
    pub capacity: u32,
    pub connect_timeout: Duration,
    pub handshake_timeout: Duration,
    pub max_frame_bytes: usize,
    pub max_queued_bytes: usize,
    /// Calls and argument bytes of one connection that may wait at once (MUX-4).
    pub max_in_flight: (usize, usize),
    pub max_blob_bytes: usize,
    pub bulk_threshold: usize,
    pub bulk_pool_bytes: usize,
    pub shm_arena_bytes: usize,
    pub busy_poll: Duration,
    pub max_sync_connections: usize,
    /// How often the failure detector beats; zero: no detector.
    pub heartbeat_interval: Duration,
    /// How long a peer may stay silent before it is declared failed.
    pub failure_timeout: Duration,
}

impl NetConfig {
    /// Who this worker is in handshakes.
    pub(crate) fn me(&self) -> super::auth::Ident {
        super::auth::Ident {
            rank: self.rank,
            incarnation: self.incarnation,
        }
    }
}

//! A group served by a standalone rendezvous that outlives its formation, so that workers can
//! be replaced (new incarnations) in one process.

use std::time::Duration;

use rpc_core::{
    Agent, Config, GroupSize, InitError, Registry, RendezvousServer, Secret, Transport,
};

/// A formed group, its rendezvous and what a replacement needs to join it.
pub struct ElasticGroup {
    /// The rendezvous, serving the group after it formed.
    pub server: RendezvousServer,
    /// The group secret.
    pub secret: Secret,
    /// The network the workers use.
    pub transport: Transport,
    /// The workers of incarnation 0 that formed the group, by rank.
    pub agents: Vec<Agent>,
    size: GroupSize,
    failure_timeout: Duration,
    registry: fn() -> Registry,
}

impl ElasticGroup {
    /// Forms a group of `world` workers over `transport`, each with `registry()`, heartbeats
    /// every 100 ms and the given failure timeout.
    pub async fn start(
        world: u32,
        transport: Transport,
        registry: fn() -> Registry,
        failure_timeout: Duration,
    ) -> Self {
        Self::start_sized(
            GroupSize::fixed(world),
            transport,
            registry,
            failure_timeout,
        )
        .await
    }

    /// Like [`ElasticGroup::start`], a group of `size`: its initial ranks form it (none for
    /// a dynamic group); the others join with [`ElasticGroup::start_rank`].
    pub async fn start_sized(
        size: GroupSize,
        transport: Transport,
        registry: fn() -> Registry,
        failure_timeout: Duration,
    ) -> Self {
        let secret = Secret::generate();
        let bind = match &transport {
            Transport::Memory(_) => "rendezvous:1",
            _ => "127.0.0.1:0",
        };
        let server = RendezvousServer::start(
            &transport,
            bind,
            secret.clone(),
            size,
            Duration::from_secs(30),
        )
        .await
        .expect("rendezvous starts");
        let mut g = Self {
            server,
            secret,
            transport,
            agents: Vec::new(),
            size,
            failure_timeout,
            registry,
        };
        g.agents = futures::future::try_join_all(
            (0..size.initial()).map(|r| rpc_core::init(g.config(r), (g.registry)())),
        )
        .await
        .expect("group forms");
        g
    }

    /// The config of rank `rank` in this group.
    pub fn config(&self, rank: u32) -> Config {
        let c = Config::new().with_max_world_size(self.size.capacity());
        let c = if self.size.is_dynamic() {
            c
        } else {
            c.with_world_size(self.size.initial())
        };
        c.with_rank(rank)
            .with_init_method(format!("tcp://{}", self.server.local_addr()))
            .with_serve_rendezvous(false)
            .with_transport(self.transport.clone())
            .with_secret(self.secret.clone())
            .with_heartbeat_interval(Duration::from_millis(100))
            .with_failure_timeout(self.failure_timeout)
            .with_shutdown_timeout(Duration::from_secs(5))
    }

    /// Starts a process for `rank` (`replace`: as the next incarnation of a failed one).
    pub async fn start_rank(&self, rank: u32, replace: bool) -> Result<Agent, InitError> {
        rpc_core::init(self.config(rank).with_replace(replace), (self.registry)()).await
    }
}

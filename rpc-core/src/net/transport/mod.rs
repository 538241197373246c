//! Byte-stream transports: TCP and an in-memory network, behind one type.
//!
//! Everything above this module (handshake, tarpc framing, frame limits, the bulk path) sees
//! only an authenticated-to-be byte stream, so one test body exercises the same code over both
//! transports. The in-memory network uses `tokio::io::duplex` pipes and names instead of
//! ports; it is meant for tests and single-process simulations.

mod memory;
pub(crate) mod tcp;

pub use memory::MemoryNetwork;

use std::io;
use std::net::IpAddr;
use tokio::io::{AsyncRead, AsyncWrite};

/// A connection: any bidirectional byte stream.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {
    /// The concrete stream, to take a TCP connection over for blocking use.
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
    /// The concrete stream, to ask a TCP connection for its addresses.
    fn as_any(&self) -> &dyn std::any::Any;
}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The blocking TCP stream under `conn`, if it is a TCP connection.
pub(crate) fn into_std_tcp(conn: Conn) -> Option<std::net::TcpStream> {
    let s = conn.into_any().downcast::<tokio::net::TcpStream>().ok()?;
    let s = s.into_std().ok()?;
    s.set_nonblocking(false).ok()?;
    Some(s)
}

/// A boxed connection.
pub(crate) type Conn = Box<dyn Io>;

/// How workers reach each other.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub enum Transport {
    /// TCP sockets (`TCP_NODELAY` on).
    #[default]
    Tcp,
    /// An in-process network; all workers of a group must share the same [`MemoryNetwork`].
    Memory(MemoryNetwork),
}

/// A bound listener.
pub(crate) enum Listener {
    Tcp(tokio::net::TcpListener),
    Memory(memory::MemListener),
}

impl Listener {
    /// A TCP listener bound already, on the runtime this is called in.
    pub(crate) fn adopt_tcp(l: std::net::TcpListener) -> io::Result<Self> {
        l.set_nonblocking(true)?;
        Ok(Self::Tcp(tokio::net::TcpListener::from_std(l)?))
    }

    /// Accepts the next connection.
    ///
    /// # Cancel safety
    /// Cancel safe: a connection is either returned or left queued.
    pub(crate) async fn accept(&mut self) -> io::Result<Conn> {
        match self {
            Self::Tcp(l) => tcp::accept(l).await,
            Self::Memory(l) => l.accept().await,
        }
    }

    /// The address peers dial.
    pub(crate) fn local_addr(&self) -> io::Result<String> {
        match self {
            Self::Tcp(l) => Ok(l.local_addr()?.to_string()),
            Self::Memory(l) => Ok(l.addr().to_owned()),
        }
    }
}

/// A bound listener not yet attached to a runtime (see [`Transport::bind_detached`]).
pub(crate) enum Detached {
    Tcp(std::net::TcpListener),
    Memory(memory::MemListener),
}

impl Detached {
    /// The address peers dial.
    pub(crate) fn local_addr(&self) -> io::Result<String> {
        match self {
            Self::Tcp(l) => Ok(l.local_addr()?.to_string()),
            Self::Memory(l) => Ok(l.addr().to_owned()),
        }
    }

    /// The listener, on the runtime this is called in.
    pub(crate) fn attach(self) -> io::Result<Listener> {
        match self {
            Self::Tcp(l) => Listener::adopt_tcp(l),
            Self::Memory(l) => Ok(Listener::Memory(l)),
        }
    }
}

impl Transport {
    /// Binds `addr` without a runtime, for a listener that runs on a runtime of its own (the
    /// failure detector's).
    pub(crate) fn bind_detached(&self, addr: &str) -> io::Result<Detached> {
        match self {
            Self::Tcp => Ok(Detached::Tcp(std::net::TcpListener::bind(addr)?)),
            Self::Memory(net) => Ok(Detached::Memory(net.bind(addr)?)),
        }
    }

    /// Binds a listener on `addr` (`host:port`; port 0 picks a free one).
    pub(crate) async fn bind(&self, addr: &str) -> io::Result<Listener> {
        match self {
            Self::Tcp => Ok(Listener::Tcp(tokio::net::TcpListener::bind(addr).await?)),
            Self::Memory(net) => Ok(Listener::Memory(net.bind(addr)?)),
        }
    }

    /// Dials `addr`; also returns the local IP used (TCP only), to advertise a reachable
    /// address when the listener is bound to a wildcard.
    pub(crate) async fn connect(&self, addr: &str) -> io::Result<(Conn, Option<IpAddr>)> {
        match self {
            Self::Tcp => tcp::connect(addr).await,
            Self::Memory(net) => Ok((net.connect(addr).await?, None)),
        }
    }
}

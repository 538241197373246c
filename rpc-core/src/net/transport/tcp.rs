//! TCP: `TCP_NODELAY` on every socket, and the kernel's own failure detection as a backstop
//! to the failure detector: keepalive probes on an idle connection and a bound on how long
//! written data may stay unacknowledged (`TCP_USER_TIMEOUT`), so a connection to a host that
//! vanished ends by itself even with heartbeats off.

use std::io;
use std::net::IpAddr;
use std::os::fd::AsFd;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

use super::Conn;

/// Idle time before the first keepalive probe, the time between probes, and how many
/// unanswered probes end the connection (about 20 s for a silent peer).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_PROBES: u32 = 5;
/// Written data unacknowledged this long ends the connection.
const USER_TIMEOUT_MS: u32 = 30_000;

/// Sets `TCP_NODELAY` and the backstops on a connected socket.
pub(crate) fn configure(fd: impl AsFd) -> io::Result<()> {
    use rustix::net::sockopt;
    let fd = fd.as_fd();
    sockopt::set_tcp_nodelay(fd, true)?;
    sockopt::set_socket_keepalive(fd, true)?;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        sockopt::set_tcp_keepidle(fd, KEEPALIVE_IDLE)?;
        sockopt::set_tcp_keepintvl(fd, KEEPALIVE_INTERVAL)?;
        sockopt::set_tcp_keepcnt(fd, KEEPALIVE_PROBES)?;
        sockopt::set_tcp_user_timeout(fd, USER_TIMEOUT_MS)?;
    }
    Ok(())
}

pub(super) async fn accept(l: &TcpListener) -> io::Result<Conn> {
    let (s, _) = l.accept().await?;
    configure(&s)?;
    Ok(Box::new(s))
}

pub(super) async fn connect(addr: &str) -> io::Result<(Conn, Option<IpAddr>)> {
    let s = TcpStream::connect(addr).await?;
    configure(&s)?;
    let ip = s.local_addr()?.ip();
    Ok((Box::new(s), Some(ip)))
}

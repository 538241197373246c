//! TCP: `TCP_NODELAY` on every socket.

use std::io;
use std::net::IpAddr;
use tokio::net::{TcpListener, TcpStream};

use super::Conn;

pub(super) async fn accept(l: &TcpListener) -> io::Result<Conn> {
    let (s, _) = l.accept().await?;
    s.set_nodelay(true)?;
    Ok(Box::new(s))
}

pub(super) async fn connect(addr: &str) -> io::Result<(Conn, Option<IpAddr>)> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let ip = s.local_addr()?.ip();
    Ok((Box::new(s), Some(ip)))
}

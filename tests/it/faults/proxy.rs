//! A TCP proxy between the relay and the server that can cut or stall every connection it
//! carries: the faults of a network (or a pooler) without touching the machine's.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::harness::server;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Link {
    /// Forwards both ways.
    Open,
    /// Closes every connection and closes each new one at once.
    Cut,
    /// Keeps every connection open but forwards nothing.
    Stalled,
}

/// Where the proxy connects to: the test server's TCP address or Unix socket.
#[derive(Debug, Clone)]
pub(super) enum Upstream {
    Tcp(String, u16),
    Unix(std::path::PathBuf),
}

/// A TCP proxy on 127.0.0.1 that can cut or stall every connection it carries.
pub(super) struct Proxy {
    pub(super) port: u16,
    link: watch::Sender<Link>,
    refused: Arc<AtomicUsize>,
    pub(super) accepted: Arc<AtomicUsize>,
    /// Bytes read but held back by a stalled link.
    held: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub(super) async fn start(upstream: Upstream) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (link, state) = watch::channel(Link::Open);
        let (refused, accepted) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let held = Arc::new(AtomicUsize::new(0));
        let task = {
            let (refused, accepted, held) = (refused.clone(), accepted.clone(), held.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else { continue };
                    if *state.borrow() == Link::Cut {
                        refused.fetch_add(1, Ordering::SeqCst);
                        drop(client);
                        continue;
                    }
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let (upstream, state, held) = (upstream.clone(), state.clone(), held.clone());
                    tokio::spawn(async move {
                        match upstream {
                            Upstream::Tcp(host, port) => {
                                if let Ok(server) = TcpStream::connect((host.as_str(), port)).await {
                                    pipe(client, server, state, held).await;
                                }
                            }
                            Upstream::Unix(path) => {
                                if let Ok(server) = tokio::net::UnixStream::connect(path).await {
                                    pipe(client, server, state, held).await;
                                }
                            }
                        }
                    });
                }
            })
        };
        Proxy { port, link, refused, accepted, held, task }
    }

    pub(super) fn set(&self, link: Link) {
        self.link.send_replace(link);
    }

    pub(super) fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// The URL of `database` through this proxy, with the test server's credentials.
    pub(super) fn url(&self, database: &str) -> pg_outbox_relay::DatabaseUrl {
        server().url_for(database).for_host("127.0.0.1", self.port).expect("a URL through the proxy")
    }

    /// How many bytes the stalled link holds back (read from one side, not yet written to the
    /// other): more than zero once something tried to cross it.
    pub(super) fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.link.send_replace(Link::Cut);
    }
}

pub(super) fn upstream(database: &str) -> Upstream {
    let url = server().url_for(database);
    let config = url.config();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(host) => Upstream::Tcp(host.clone(), port),
        tokio_postgres::config::Host::Unix(dir) => Upstream::Unix(dir.join(format!(".s.PGSQL.{port}"))),
    }
}

/// Copies both ways until either side closes or the link is cut; then both sockets are closed.
async fn pipe<S>(client: TcpStream, server: S, mut state: watch::Receiver<Link>, held: Arc<AtomicUsize>)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = tokio::io::split(server);
    tokio::select! {
        _ = forward(client_read, server_write, state.clone(), &held) => {}
        _ = forward(server_read, client_write, state.clone(), &held) => {}
        _ = state.wait_for(|link| *link == Link::Cut) => {}
    }
}

/// Copies `from` to `to`; while the link is stalled, what was read is held back (and counted).
async fn forward(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut state: watch::Receiver<Link>,
    held: &AtomicUsize,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if *state.borrow() == Link::Stalled {
            held.fetch_add(n, Ordering::SeqCst);
            let resumed = state.wait_for(|link| *link != Link::Stalled).await.is_ok();
            held.fetch_sub(n, Ordering::SeqCst);
            if !resumed {
                return;
            }
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

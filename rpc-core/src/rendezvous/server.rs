//! The rendezvous's side: forms the group, then stays up as the group's membership service.
//!
//! One task owns the state (every rank's current incarnation and standing, the generation);
//! each connection has a reader task (its join, then a member's reports) and, once it is a
//! member, a writer task fed by a bounded queue, so a member that stops reading never stalls
//! the others.
//!
//! - RDV-1: the group forms once all its initial ranks joined, or fails for everyone (naming
//!   the missing ranks) when the deadline passes. A dynamic group (no initial ranks) is formed
//!   from the start.
//! - RDV-2: after that, a join for a rank is admitted only as its next incarnation: when the
//!   rank failed or left, or when the joiner says it replaces the holder (it was restarted);
//!   or, for a vacant rank within the capacity, as its first (a name is never held by two
//!   ranks). Every member is told before the new incarnation gets its view. Joins for ranks
//!   past the initial ones that come while the group forms wait until it has formed.
//! - RDV-3: a failure is decided once per incarnation and told to all.
//! - RDV-4: a failure is decided on evidence, not on one member's report (`evidence.rs`).
//! - RDV-5: a live holder is replaced only by whoever may start its replacement: each
//!   incarnation gets a token of its own when it joins (it tells its launcher, which hands
//!   the token to the process it restarts); a replacement without it waits until the group
//!   has declared the holder failed. A process that merely holds the group's secret cannot
//!   evict a live member.
//! - RDV-6: a member whose link broke dials again and resumes: with its incarnation and token
//!   it is re-attached (a link of an earlier connection that ends later detaches nothing) and
//!   sent the group as it is, so it misses no change; one the group no longer counts is
//!   refused, naming why.

use futures::StreamExt;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;

use super::evidence::{Seen, Suspicions};
use super::{
    framed, recv, refusal, send, Framed_, GroupSize, Join, Member, Report, Update, Verdict, View,
};
use crate::net::auth::{self, ConnKind, Secret};
use crate::net::transport::{Conn, Listener};
use crate::net::{Endpoint, MembershipChange, MembershipEvent, Standing, WireProtection};

/// How many updates may wait for one member before it is cut off from the service.
const MEMBER_QUEUE: usize = 256;

enum Event {
    /// A connection that authenticated and sent its join.
    Join(Join, Box<Framed_>),
    /// A member's report: its rank, its incarnation, what it says.
    Report(u32, u64, Report),
    /// A member's connection ended: its rank, incarnation and link number.
    Closed(u32, u64, u64),
}

struct Slot {
    join: Join,
    incarnation: u64,
    standing: Standing,
    /// The member's queue of updates, while its connection lasts.
    out: Option<mpsc::Sender<Update>>,
    /// What a replacement of this incarnation presents (RDV-5), and a resume (RDV-6).
    token: String,
    /// The number of the member's current connection (RDV-6).
    link: u64,
}

impl Slot {
    /// The slot of a rank's first incarnation, alive, before its connection is up.
    fn first(join: Join) -> Self {
        Self {
            join,
            incarnation: 0,
            standing: Standing::Alive,
            out: None,
            token: new_token(),
            link: 0,
        }
    }
}

/// 16 random bytes, hex.
fn new_token() -> String {
    let mut raw = [0u8; 16];
    crate::net::auth::fill_random(&mut raw);
    raw.iter().map(|b| format!("{b:02x}")).collect()
}

struct State {
    /// The group's identity ([`View::job`]).
    job: String,
    size: GroupSize,
    /// The ranks some worker has joined (the others are vacant).
    slots: BTreeMap<u32, Slot>,
    /// Connections of initial ranks waiting for the group to form.
    pending: BTreeMap<u32, Framed_>,
    /// Joins for ranks past the initial ones that came while the group formed.
    early: Vec<(Join, Framed_)>,
    generation: u64,
    events: mpsc::Sender<Event>,
    watchers: broadcast::Sender<MembershipEvent>,
    /// Failure reports not confirmed yet (RDV-4).
    suspicions: Suspicions,
    /// Member connections so far (each gets the next number, RDV-6).
    links: u64,
    /// Shared with its handle: faults tests inject (a frozen rendezvous, reports lost on
    /// their way), the job's end and name, the ranks linked now.
    shared: Arc<super::Shared>,
}

/// Serves the group: formation until `deadline` (RDV-1), then membership for as long as the
/// task runs.
pub(super) async fn serve(
    mut listener: Listener,
    secret: Secret,
    size: GroupSize,
    deadline: Instant,
    watchers: broadcast::Sender<MembershipEvent>,
    (formed_tx, shared): (tokio::sync::watch::Sender<bool>, Arc<super::Shared>),
) {
    let initial = size.initial();
    // Bounded: joins and reports are few; a full queue slows the readers, it drops nothing.
    let (tx, mut rx) = mpsc::channel::<Event>(256);
    let mut state = State {
        job: new_token(),
        size,
        slots: BTreeMap::new(),
        pending: BTreeMap::new(),
        early: Vec::new(),
        generation: 0,
        events: tx.clone(),
        watchers,
        suspicions: Suspicions::default(),
        links: 0,
        shared,
    };
    let gate = auth::Gate::default();
    let mut formed = size.is_dynamic();
    if formed {
        let _ = formed_tx.send(true);
    }
    loop {
        tokio::select! {
            acc = listener.accept() => {
                let Ok(conn) = acc else { continue };
                let (tx, secret, gate) = (tx.clone(), secret.clone(), gate.clone());
                let by = if formed { Instant::now() + Duration::from_secs(30) } else { deadline };
                let ended = Arc::clone(&state.shared);
                tokio::spawn(read_join(conn, (tx, ended), secret, gate, by));
            }
            Some(ev) = rx.recv() => {
                match ev {
                Event::Join(join, f) if !formed && join.rank >= initial && join.size == size => {
                    state.early.push((join, *f));
                }
                Event::Join(join, f) if !formed => {
                    let restarted =
                        state.slots.get(&join.rank).is_some_and(|s| s.join.name == join.name);
                    if join.replace && restarted {
                        // Restarted before the group formed: the new process takes the place of
                        // the one that joined first (whose connection is dropped).
                        let rank = join.rank;
                        state.slots.insert(rank, Slot::first(join));
                        state.pending.insert(rank, *f);
                        continue;
                    }
                    if let Some(why) = refusal(&join, size, state.slots.values().map(|s| &s.join)) {
                        tracing::warn!(%why, "rendezvous refused a worker");
                        refuse(*f, why);
                        continue;
                    }
                    let rank = join.rank;
                    state.slots.insert(rank, Slot::first(join));
                    state.pending.insert(rank, *f);
                    if state.slots.len() == initial as usize {
                        formed = true;
                        state.form();
                        let _ = formed_tx.send(true);
                        for (join, f) in std::mem::take(&mut state.early) {
                            state.rejoin(join, f);
                        }
                    }
                }
                Event::Join(join, f) => state.rejoin(join, *f),
                Event::Report(rank, inc, r) => state.report(rank, inc, r),
                Event::Closed(rank, inc, link) => state.closed(rank, inc, link),
            }
            // Any change may complete the evidence on a suspicion (RDV-4).
            if formed {
                state.decide();
            }
            state.publish_linked();
            }
            _ = tokio::time::sleep_until(deadline), if !formed => {
                let missing: Vec<u32> =
                    (0..initial).filter(|r| !state.slots.contains_key(r)).collect();
                tracing::warn!(?missing, "rendezvous timed out");
                let v = Verdict::Missing(missing);
                let early = std::mem::take(&mut state.early).into_iter().map(|(_, f)| f);
                for mut f in std::mem::take(&mut state.pending).into_values().chain(early) {
                    let _ = tokio::time::timeout(Duration::from_secs(2), send(&mut f, &v)).await;
                }
                return;
            }
        }
    }
}

/// Authenticates a connection and reads its join, by `by`.
async fn read_join(
    mut conn: Conn,
    (tx, switches): (mpsc::Sender<Event>, Arc<super::Shared>),
    secret: Secret,
    gate: auth::Gate,
    by: Instant,
) {
    let left = by.saturating_duration_since(Instant::now());
    // The server asks for the least (a joiner may ask for more).
    let conn = match gate
        .handshake(
            &mut conn,
            &secret,
            WireProtection::Auto,
            left,
            auth::RENDEZVOUS,
        )
        .await
    {
        Ok(a) if a.kind == ConnKind::Rendezvous => a.session.wrap(conn),
        Ok(a) => {
            tracing::warn!(kind = ?a.kind, "rendezvous got a non-rendezvous connection");
            return;
        }
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
        Err(e) => {
            tracing::warn!(cause = %e, "rendezvous refused a connection");
            return;
        }
    };
    let mut f = framed(conn);
    if switches.ended.load(Ordering::SeqCst) {
        // RDV-10: said first, whatever the connection came for (a join or a probe).
        let _ = tokio::time::timeout(Duration::from_secs(5), send(&mut f, &Verdict::Ended)).await;
        return;
    }
    if let Ok(Ok(join)) = tokio::time::timeout_at(by, recv::<Join>(&mut f)).await {
        let _ = tx.send(Event::Join(join, Box::new(f))).await;
    }
}

fn refuse(mut f: Framed_, why: String) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(5), send(&mut f, &Verdict::Refused(why)))
            .await;
    });
}

impl State {
    fn view(&self) -> View {
        View {
            job: self.job.clone(),
            named: self.shared.named.get().cloned(),
            sink: self.shared.sink.get().cloned(),
            generation: self.generation,
            members: (0..self.size.capacity())
                .map(|r| match self.slots.get(&r) {
                    Some(s) => Member {
                        endpoint: Endpoint {
                            name: s.join.name.clone(),
                            addr: s.join.addr.clone(),
                            heartbeat: s.join.heartbeat.clone(),
                            incarnation: s.incarnation,
                        },
                        standing: s.standing.clone(),
                    },
                    None => Member::vacant(),
                })
                .collect(),
        }
    }

    /// The verdict that admits `rank`: the group, and that incarnation's token (RDV-5).
    fn table_for(&self, rank: u32) -> Verdict {
        let token = self
            .slots
            .get(&rank)
            .map_or_else(String::new, |s| s.token.clone());
        Verdict::Table(self.view(), token)
    }

    /// Every rank joined: each gets the table and becomes a member.
    fn form(&mut self) {
        let view = self.view();
        for (rank, f) in std::mem::take(&mut self.pending) {
            let token = self
                .slots
                .get(&rank)
                .map_or_else(String::new, |s| s.token.clone());
            self.admit(rank, f, Verdict::Table(view.clone(), token));
        }
        tracing::info!(size = %self.size, "group formed");
    }

    /// Tells the server's handle which ranks have a member linked now
    /// (`RendezvousServer::linked_ranks`).
    fn publish_linked(&self) {
        let linked = self
            .slots
            .iter()
            .filter(|(_, s)| s.out.is_some())
            .map(|(r, _)| *r)
            .collect();
        *self.shared.linked.lock().unwrap_or_else(|p| p.into_inner()) = linked;
    }

    /// Sends `first` on `f`, then serves the member's updates and reports.
    fn admit(&mut self, rank: u32, f: Framed_, first: Verdict) {
        let Some(slot) = self.slots.get_mut(&rank) else {
            return;
        };
        let incarnation = slot.incarnation;
        let (out_tx, mut out_rx) = mpsc::channel::<Update>(MEMBER_QUEUE);
        slot.out = Some(out_tx);
        self.links += 1;
        slot.link = self.links;
        let link = self.links;
        let events = self.events.clone();
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            let (mut sink, mut stream) = f.split();
            let hold = || async {
                while shared.silenced.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            let writer = async {
                hold().await;
                if super::send_sink(&mut sink, &first).await.is_err() {
                    return;
                }
                // RDV-7: a word at least every LINK_TICK, so that members notice silence.
                let mut tick = tokio::time::interval(super::LINK_TICK);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    let u = tokio::select! {
                        u = out_rx.recv() => match u {
                            Some(u) => u,
                            None => return,
                        },
                        _ = tick.tick() => Update::Alive,
                    };
                    // RDV-10: the job ended; a member still linked loses the link (and its
                    // redial is told that the job ended).
                    if shared.ended.load(Ordering::SeqCst) {
                        return;
                    }
                    hold().await;
                    let sent = tokio::time::timeout(
                        Duration::from_secs(10),
                        super::send_sink(&mut sink, &u),
                    )
                    .await;
                    if !matches!(sent, Ok(Ok(()))) {
                        return;
                    }
                }
            };
            let reader = async {
                while let Some(Ok(frame)) = stream.next().await {
                    match bincode::deserialize::<Report>(&frame) {
                        Ok(_) if shared.deaf.load(Ordering::Relaxed) => {}
                        Ok(r) => {
                            if events
                                .send(Event::Report(rank, incarnation, r))
                                .await
                                .is_err()
                            {
                                return;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(rank, cause = %e, "rendezvous got a bad report");
                            return;
                        }
                    }
                }
            };
            tokio::select! {
                () = writer => {}
                () = reader => {}
            }
            let _ = events.send(Event::Closed(rank, incarnation, link)).await;
        });
    }

    /// Tells every member (but `except`) and every watcher of a change of `rank`.
    fn announce(&mut self, rank: u32, update: Update, except: Option<u32>) {
        self.generation += 1;
        let Some(slot) = self.slots.get(&rank) else {
            return;
        };
        let change = match &update {
            Update::Joined { endpoint, .. } => MembershipChange::Joined {
                addr: endpoint.addr.clone(),
            },
            Update::Left { .. } => MembershipChange::Left,
            Update::Failed { cause, .. } => MembershipChange::Failed {
                cause: cause.clone(),
            },
            Update::Alive => return,
        };
        let _ = self.watchers.send(MembershipEvent {
            generation: self.generation,
            rank,
            name: slot.join.name.clone(),
            incarnation: slot.incarnation,
            change,
        });
        for (r, s) in &mut self.slots {
            if Some(*r) == except {
                continue;
            }
            if let Some(out) = &s.out {
                if out.try_send(update.clone()).is_err() {
                    tracing::warn!(rank = *r, "a member stopped reading membership updates");
                    s.out = None;
                }
            }
        }
    }

    /// A member that lost its link resumes it (RDV-6).
    fn resume(&mut self, join: Join, inc: u64, f: Framed_) {
        let why = match self.slots.get(&join.rank) {
            None => Some(format!("rank {} has no member", join.rank)),
            Some(s) if s.incarnation != inc => Some(format!(
                "rank {} is held by incarnation {} now, not {inc}",
                join.rank, s.incarnation
            )),
            Some(s) if join.token.as_deref() != Some(s.token.as_str()) => Some(format!(
                "a resume of rank {} (incarnation {inc}) without its token",
                join.rank
            )),
            Some(s) => match &s.standing {
                Standing::Failed(cause) => Some(format!(
                    "incarnation {inc} of rank {} was declared failed: {cause}",
                    join.rank
                )),
                Standing::Left => Some(format!("rank {} left the group", join.rank)),
                _ => None,
            },
        };
        if let Some(why) = why {
            tracing::warn!(%why, "rendezvous refused a resume");
            refuse(f, why);
            return;
        }
        let rank = join.rank;
        tracing::info!(
            rank,
            incarnation = inc,
            "a member's rendezvous link resumed"
        );
        let table = self.table_for(rank);
        self.admit(rank, f, table);
    }

    /// A join after the group formed (RDV-2).
    fn rejoin(&mut self, join: Join, f: Framed_) {
        if let Some(inc) = join.resume {
            return self.resume(join, inc, f);
        }
        let why = if join.size != self.size || join.rank >= self.size.capacity() {
            refusal(&join, self.size, std::iter::empty())
        } else {
            match self.slots.get(&join.rank) {
                // A vacant rank: its first worker, under a name no other rank holds.
                None => self
                    .slots
                    .iter()
                    .find(|(_, s)| s.join.name == join.name)
                    .map(|(r, _)| format!("name `{}` already taken by rank {r}", join.name)),
                Some(s) if s.join.name != join.name => Some(format!(
                    "rank {} is `{}`; `{}` cannot take it (a replacement keeps the name)",
                    join.rank, s.join.name, join.name
                )),
                Some(s) if s.standing == Standing::Alive && !join.replace => Some(format!(
                    "rank {} (`{}`) is held by incarnation {}, which has not failed; a \
                     restarted process replaces it (the launcher's restart count is positive, \
                     or Config::replace is set)",
                    join.rank, join.name, s.incarnation
                )),
                Some(s)
                    if s.standing == Standing::Alive
                        && join.token.as_deref() != Some(s.token.as_str()) =>
                {
                    // RDV-5: not yet; the joiner tries again until its deadline.
                    let why = format!(
                        "rank {} (`{}`) is held by incarnation {}, which has not failed, and \
                         this process has no token from its launcher to replace it",
                        join.rank, join.name, s.incarnation
                    );
                    tracing::info!(%why, "a replacement waits for its rank");
                    tokio::spawn(async move {
                        let (mut f, held) = (f, Verdict::Held(why));
                        let _ =
                            tokio::time::timeout(Duration::from_secs(5), send(&mut f, &held)).await;
                    });
                    return;
                }
                Some(_) => None,
            }
        };
        if let Some(why) = why {
            tracing::warn!(%why, "rendezvous refused a worker");
            refuse(f, why);
            return;
        }
        let rank = join.rank;
        let slot = match self.slots.get(&rank) {
            Some(slot) => {
                if slot.standing == Standing::Alive {
                    // The holder is being replaced: it has failed as far as the group is
                    // concerned.
                    let inc = slot.incarnation;
                    self.fail(
                        rank,
                        inc,
                        format!("replaced by a restarted process at {}", join.addr),
                    );
                }
                let slot = self.slots.get_mut(&rank).expect("checked");
                slot.incarnation += 1;
                slot.standing = Standing::Alive;
                slot.join = join;
                slot.out = None;
                slot.token = new_token();
                slot
            }
            None => self.slots.entry(rank).or_insert_with(|| Slot::first(join)),
        };
        let endpoint = Endpoint {
            name: slot.join.name.clone(),
            addr: slot.join.addr.clone(),
            heartbeat: slot.join.heartbeat.clone(),
            incarnation: slot.incarnation,
        };
        tracing::info!(
            rank,
            incarnation = endpoint.incarnation,
            addr = %endpoint.addr,
            "a new incarnation joined",
        );
        self.announce(rank, Update::Joined { rank, endpoint }, Some(rank));
        let table = self.table_for(rank);
        self.admit(rank, f, table);
    }

    /// Incarnation `inc` of `rank` failed (RDV-3: once).
    fn fail(&mut self, rank: u32, inc: u64, cause: String) {
        let Some(slot) = self.slots.get_mut(&rank) else {
            return;
        };
        if slot.incarnation != inc || slot.standing != Standing::Alive {
            return;
        }
        slot.standing = Standing::Failed(cause.clone());
        slot.out = None;
        tracing::warn!(rank, incarnation = inc, %cause, "member failed");
        self.announce(
            rank,
            Update::Failed {
                rank,
                incarnation: inc,
                cause,
            },
            Some(rank),
        );
    }

    fn report(&mut self, from: u32, from_inc: u64, r: Report) {
        let current = self.slots.get(&from).map(|s| (s.incarnation, &s.standing));
        if current != Some((from_inc, &Standing::Alive)) {
            // MEM-1: a replaced incarnation is not heard; RDV-4: nor one the group declared
            // failed or that left.
            return;
        }
        match r {
            Report::Failed {
                rank,
                incarnation,
                cause,
            } => {
                let name = self
                    .slots
                    .get(&from)
                    .map_or(String::new(), |s| s.join.name.clone());
                let cause = format!("reported by `{name}`: {cause}");
                self.suspicions.report(rank, incarnation, from, cause);
            }
            Report::Leaving => {
                let Some(slot) = self.slots.get_mut(&from) else {
                    return;
                };
                if slot.standing != Standing::Alive {
                    return;
                }
                slot.standing = Standing::Left;
                tracing::info!(rank = from, "member left the group");
                // The leaver is told too: that is its acknowledgement.
                self.announce(
                    from,
                    Update::Left {
                        rank: from,
                        incarnation: from_inc,
                    },
                    None,
                );
            }
        }
    }

    /// Declares the failures the evidence now confirms (RDV-4), until none is left: each
    /// changes who the live members are.
    fn decide(&mut self) {
        loop {
            let seen = self
                .slots
                .iter()
                .map(|(&r, s)| {
                    let m = Seen {
                        incarnation: s.incarnation,
                        alive: s.standing == Standing::Alive,
                        linked: s.out.is_some(),
                    };
                    (r, m)
                })
                .collect();
            let confirmed = self.suspicions.confirmed(&seen);
            if confirmed.is_empty() {
                return;
            }
            for (rank, inc, cause) in confirmed {
                self.fail(rank, inc, cause);
            }
        }
    }

    /// A member's connection ended: it is not told of changes any more. Whether it failed is
    /// for the failure detectors to say (a connection to the rendezvous can break alone).
    fn closed(&mut self, rank: u32, inc: u64, link: u64) {
        if let Some(s) = self.slots.get_mut(&rank) {
            // An earlier link that ends after a resume detaches nothing (RDV-6).
            if s.incarnation == inc && s.link == link {
                s.out = None;
            }
        }
    }
}

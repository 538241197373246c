//! The launchers' rendezvous in etcd: `--rdzv etcd://HOST:PORT[,HOST:PORT...]/JOB`, for jobs
//! on many hosts that must outlive any one of them (torchrun's etcd backend, in its spirit).
//!
//! The group's own rendezvous (membership, failure verdicts, barriers: `rpc_core`'s) still
//! runs in rank 0's process, but rank 0 is no longer tied to a host: the launchers agree in
//! etcd, round after round, which nodes take part and in which order (node rank = order of
//! joining), and node 0 of a round serves the rendezvous on a port it bound and handed to
//! its rank 0 (RDV-8). When a round fails (a child fails on any node, a node's launcher
//! leaves, is killed, frozen or cut off from etcd and its lease expires) the next round
//! begins everywhere: every launcher stops its children and joins again, and the round forms
//! from the first `--nnodes` launchers that join, spares included. So the loss of the host
//! of rank 0 and the rendezvous costs one restart from the checkpoint, no longer the job.
//!
//! The rules (ETC-1..4, cited by the tests):
//!
//! - ETC-1: a round's members are written once, by a transaction; every launcher reads the
//!   same list, and one that is not on it waits, as a spare, for the next round.
//! - ETC-2: a launcher runs children only while the round it joined is the job's current
//!   round and its lease holds: a newer round, a member whose lease is gone, or its own lease
//!   lost (frozen, cut off from etcd) stops its children within about a second (the fence:
//!   one set of ranks at a time).
//! - ETC-3: restarts are counted by round (`gen - base`) for the whole job, so every node
//!   stops at the same `--max-restarts`; a process's failure or a node's loss is one restart.
//! - ETC-4: the job ends once, with one status, for every launcher (spares included): 0 only
//!   when every member node's processes succeeded in the same round; otherwise the status of
//!   the failure that ended it (out of restarts, or a child's [`crate::FATAL_EXIT_CODE`]).
//!
//! Every wait has a bound: forming a round `--join-timeout`, etcd's requests 5 s each, a
//! lost lease is taken again within 30 s or the launcher exits 1 naming etcd, and the nodes of
//! a round that succeeded must say so within 60 s. A spare waits as long as the job runs.

#[cfg(feature = "etcd")]
mod run;
#[cfg(feature = "etcd")]
mod store;

#[cfg(feature = "etcd")]
pub(crate) use run::run;

/// Where the launchers meet in etcd: its endpoints and the job's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Spec {
    /// `HOST:PORT` of each etcd member.
    pub endpoints: Vec<String>,
    /// The job: the keys' prefix, `/rpcrun/<job>/`.
    pub job: String,
}

impl Spec {
    /// The spec of an `etcd://` rendezvous; `None` for any other (a `HOST:PORT`).
    pub(crate) fn parse(rdzv: &str) -> Option<Result<Self, String>> {
        let rest = rdzv.strip_prefix("etcd://")?;
        let bad = |why: &str| {
            Some(Err(format!(
                "--rdzv {rdzv:?}: {why} (expected etcd://HOST:PORT[,HOST:PORT...]/JOB)"
            )))
        };
        let Some((hosts, job)) = rest.split_once('/') else {
            return bad("no job name");
        };
        if job.is_empty()
            || !job
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return bad("the job name must be letters, digits, '-', '_' or '.'");
        }
        let endpoints: Vec<String> = hosts.split(',').map(str::to_owned).collect();
        for e in &endpoints {
            match e.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {}
                _ => return bad(&format!("{e:?} is not HOST:PORT")),
            }
        }
        Some(Ok(Self {
            endpoints,
            job: job.to_owned(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_addresses_are_parsed_or_refused_naming_the_part() {
        assert!(Spec::parse("node0:29500").is_none());
        let s = Spec::parse("etcd://a:2379,10.0.0.2:2379/job-7")
            .unwrap()
            .unwrap();
        assert_eq!(s.endpoints, ["a:2379", "10.0.0.2:2379"]);
        assert_eq!(s.job, "job-7");
        let why = |r: &str| Spec::parse(r).unwrap().unwrap_err();
        assert!(why("etcd://a:2379").contains("no job name"));
        assert!(why("etcd://a:2379/").contains("job name must be"));
        assert!(why("etcd://a:2379/x/y").contains("job name must be"));
        assert!(why("etcd://a/x").contains("\"a\" is not HOST:PORT"));
    }
}

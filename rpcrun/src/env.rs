//! The variables each child is started with.

use std::path::Path;

use crate::Launch;

/// Where the group meets: the rendezvous host and port every child is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Rendezvous {
    pub host: String,
    pub port: u16,
}

/// The variables of local process `local_rank` in attempt `restart`: torchrun's names (which
/// `rpc_core::Config` reads), the restart count, the secret's file and the launch's extras.
pub(crate) fn child_env(
    launch: &Launch,
    local_rank: u32,
    restart: u32,
    rdzv: &Rendezvous,
    secret_file: Option<&Path>,
) -> Vec<(String, String)> {
    let rank = launch.node_rank * launch.nproc + local_rank;
    let mut env = vec![
        (rpc_core::RANK_ENV[0].to_owned(), rank.to_string()),
        ("LOCAL_RANK".to_owned(), local_rank.to_string()),
        (
            rpc_core::WORLD_SIZE_ENV[0].to_owned(),
            launch.world_size().to_string(),
        ),
        ("LOCAL_WORLD_SIZE".to_owned(), launch.nproc.to_string()),
        ("GROUP_RANK".to_owned(), launch.node_rank.to_string()),
        ("MASTER_ADDR".to_owned(), rdzv.host.clone()),
        ("MASTER_PORT".to_owned(), rdzv.port.to_string()),
        (
            rpc_core::RESTART_COUNT_ENV[0].to_owned(),
            restart.to_string(),
        ),
        (
            "RPC_MAX_RESTARTS".to_owned(),
            launch.max_restarts.to_string(),
        ),
        (
            rpc_core::RESTART_MODE_ENV.to_owned(),
            match launch.restart {
                crate::Restart::Group => "group",
                crate::Restart::Worker => "worker",
            }
            .to_owned(),
        ),
    ];
    if let Some(f) = secret_file {
        env.push((
            rpc_core::SECRET_FILE_ENV.to_owned(),
            f.display().to_string(),
        ));
    }
    env.extend(launch.env.iter().cloned());
    env
}

/// Variables removed from every child's environment: another launcher's rank variables (a
/// stale `SLURM_PROCID` must not contradict ours; ours come first anyway) are kept, but a
/// secret given as text is replaced by the file, and a rendezvous socket handed to this
/// launcher is not named to its children (RDV-8: the one they may get is this launcher's).
pub(crate) const REMOVED: [&str; 2] = [rpc_core::SECRET_ENV, rpc_core::RENDEZVOUS_FD_ENV];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(l: &Launch, local: u32, restart: u32) -> HashMap<String, String> {
        let rdzv = Rendezvous {
            host: "node0".into(),
            port: 29500,
        };
        child_env(l, local, restart, &rdzv, Some(Path::new("/run/s")))
            .into_iter()
            .collect()
    }

    #[test]
    fn ranks_follow_the_node_and_the_local_rank() {
        let l = Launch::new("p").nproc(4).nodes(3, 2).env("X", "y");
        let e = env_of(&l, 1, 2);
        for (k, v) in [
            ("RANK", "9"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "12"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("RPC_RESTART_COUNT", "2"),
            ("RPC_SECRET_FILE", "/run/s"),
            ("X", "y"),
        ] {
            assert_eq!(e.get(k).map(String::as_str), Some(v), "{k} in {e:?}");
        }
        assert!(!e.contains_key("RPC_SECRET"));
        assert_eq!(e["RPC_RESTART_MODE"], "group");
        let e = env_of(&Launch::new("p").restart(crate::Restart::Worker), 0, 0);
        assert_eq!(e["RPC_RESTART_MODE"], "worker");
    }

    #[test]
    fn launches_that_cannot_work_are_refused_before_anything_starts() {
        let why = |l: Launch| l.validate().unwrap_err().to_string();
        assert!(why(Launch::new("p").nproc(0)).contains("must be positive"));
        assert!(why(Launch::new("p").nodes(2, 2)).contains("--node-rank 2 is outside"));
        assert!(why(Launch::new("p").nodes(2, 0)).contains("needs --rdzv"));
        assert!(why(Launch::new("p").rendezvous("nohost")).contains("not HOST:PORT"));
        assert!(why(Launch::new("p").rendezvous("h:99999")).contains("not HOST:PORT"));
        assert!(Launch::new("p")
            .nodes(2, 1)
            .rendezvous("h:1")
            .validate()
            .is_ok());
    }
}

//! The configuration's resolution from `Config` and the environment.

use super::*;
use crate::rendezvous::GroupSize;
use std::collections::HashMap;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

fn base() -> Config {
    Config::new().with_secret(Secret::new("a secret of many bytes"))
}

/// RDV-8: a rendezvous listener handed over is served on only by the worker that serves
/// the rendezvous, and only if it listens on the rendezvous's port; a variable that names
/// no socket this process inherited is refused, naming it.
#[test]
fn a_handed_rendezvous_listener_must_listen_on_the_rendezvous_port() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let vars = |p: u16| {
        let p = p.to_string();
        env(&[
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &p),
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
        ])
    };
    let handed = || base().with_rendezvous_listener(l.try_clone().unwrap());
    let r = handed().resolve_with(&vars(port)).unwrap();
    let got = r
        .rendezvous_listener
        .expect("served on")
        .local_addr()
        .unwrap();
    assert_eq!(got.port(), port);
    let e = handed()
        .resolve_with(&vars(port.wrapping_sub(1).max(1)))
        .unwrap_err();
    assert!(e.to_string().contains("listens on 127.0.0.1:"), "{e}");
    let r = handed()
        .with_serve_rendezvous(false)
        .resolve_with(&vars(port))
        .unwrap();
    assert!(r.rendezvous_listener.is_none());
    // Descriptor 1 is this process's stdout, not a socket.
    let e = base()
        .resolve_with(&|k| match k {
            RENDEZVOUS_FD_ENV => Some("1".to_owned()),
            k => vars(port)(k),
        })
        .unwrap_err();
    assert!(
        e.to_string().contains("RPC_RENDEZVOUS_FD=\"1\" names no"),
        "{e}"
    );
}

/// A trace that cannot be written is refused as the worker starts, naming the path, from
/// [`Config::trace`] or from `RPC_TRACE`: a worker without `rpcrun` ran its whole job and
/// only then warned that its part was not written. A good path gets its parts' directory.
#[test]
fn a_trace_that_cannot_be_written_is_refused_at_start() {
    let dir = std::env::temp_dir().join(format!("config-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a-file"), "").unwrap();
    let group = [
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let vars = env(&group);
    let e = base().with_trace(&dir).resolve_with(&vars).unwrap_err();
    assert!(e.to_string().contains("is a directory"), "{e}");
    let under_file = dir.join("a-file/job.json");
    let e = base()
        .with_trace(&under_file)
        .resolve_with(&vars)
        .unwrap_err();
    let want = format!("trace: {}: cannot create", under_file.display());
    assert!(e.to_string().contains(&want), "{e}");
    let from_env = under_file.display().to_string();
    let mut traced = group.to_vec();
    traced.push((crate::trace::TRACE_ENV, &from_env));
    let vars_traced = env(&traced);
    let e = base().resolve_with(&vars_traced).unwrap_err();
    assert!(e.to_string().contains(&want), "{e}");
    let e = base()
        .with_trace_capacity(0)
        .resolve_with(&vars)
        .unwrap_err();
    assert!(
        e.to_string().contains("trace_capacity must be positive"),
        "{e}"
    );
    let good = dir.join("job.json");
    let r = base().with_trace(&good).resolve_with(&vars).unwrap();
    assert!(r.tracer.is_on());
    assert!(crate::trace::parts_dir(&good).is_dir());
    let _ = std::fs::remove_dir_all(&dir);
}

/// TR-7: the job's name is the launcher's (ours, then torchrun's); torchrun's default, "none",
/// names no job (every run would share it), so the rendezvous's drawn id is used.
#[test]
fn the_job_is_named_by_its_launcher_unless_torchrun_gave_it_no_name() {
    let job = |vars: &[(&str, &str)]| {
        let cfg = base().with_rank(0).with_world_size(1);
        cfg.with_init_method("tcp://a:1")
            .resolve_with(&env(vars))
            .unwrap()
            .job_id
    };
    assert_eq!(job(&[("RPC_JOB_ID", "j1")]).as_deref(), Some("j1"));
    let both = [("RPC_JOB_ID", "j1"), ("TORCHELASTIC_RUN_ID", "t1")];
    assert_eq!(job(&both).as_deref(), Some("j1"));
    assert_eq!(job(&[("TORCHELASTIC_RUN_ID", "t1")]).as_deref(), Some("t1"));
    assert_eq!(job(&[("TORCHELASTIC_RUN_ID", "none")]), None);
    assert_eq!(job(&[("RPC_JOB_ID", " ")]), None);
    assert_eq!(job(&[]), None);
}

#[test]
fn torchrun_variables() {
    let r = base()
        .resolve_with(&env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
    assert_eq!(
        (r.net.rank, r.net.capacity, r.rendezvous.as_str()),
        (2, 4, "127.0.0.1:29500")
    );
    assert_eq!(r.name, "worker2");
    assert!(!r.serve_rendezvous);
    assert_eq!(r.listen_addr, "127.0.0.1:0");
}

#[test]
fn under_torchrun_the_rendezvous_takes_the_port_after_its_store() {
    let vars = [
        ("MASTER_ADDR", "node1"),
        ("MASTER_PORT", "29500"),
        ("RANK", "1"),
        ("WORLD_SIZE", "3"),
    ];
    let r = base().resolve_with(&env(&vars)).unwrap();
    assert_eq!(r.rendezvous, "node1:29500");
    let mut torch = vars.to_vec();
    torch.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
    let r = base().resolve_with(&env(&torch)).unwrap();
    assert_eq!(r.rendezvous, "node1:29501");
    torch[1] = ("MASTER_PORT", "65535");
    let e = base().resolve_with(&env(&torch)).unwrap_err();
    assert!(e.to_string().contains("no next port"), "{e}");
}

#[test]
fn slurm_and_openmpi_variables() {
    let m = [("MASTER_ADDR", "node1"), ("MASTER_PORT", "1")];
    let r = base()
        .resolve_with(&env(&[
            m[0],
            m[1],
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
        ]))
        .unwrap();
    assert_eq!((r.net.rank, r.net.capacity), (0, 8));
    assert!(r.serve_rendezvous);
    assert_eq!(r.listen_addr, "0.0.0.0:0");
    let r = base()
        .resolve_with(&env(&[
            m[0],
            m[1],
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "5"),
        ]))
        .unwrap();
    assert_eq!((r.net.rank, r.net.capacity), (3, 5));
    let r = base()
        .resolve_with(&env(&[m[0], m[1], ("PMI_RANK", "2"), ("PMI_SIZE", "4")]))
        .unwrap();
    assert_eq!((r.net.rank, r.net.capacity), (2, 4));
    // torchrun's variables win over a scheduler's.
    let r = base()
        .resolve_with(&env(&[
            m[0],
            m[1],
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
        ]))
        .unwrap();
    assert_eq!((r.net.rank, r.net.capacity), (1, 2));
    let e = base()
        .resolve_with(&env(&[m[0], m[1]]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("PMI_RANK"), "{e}");
}

#[test]
fn detector_settings_from_config_or_env() {
    let base = || {
        base()
            .with_rank(0)
            .with_world_size(1)
            .with_init_method("tcp://a:1")
    };
    let r = base().resolve_with(&env(&[])).unwrap();
    assert_eq!(r.net.heartbeat_interval, Duration::from_millis(250));
    assert_eq!(r.net.failure_timeout, Duration::from_millis(1500));
    let r = base()
        .resolve_with(&env(&[
            ("RPC_HEARTBEAT_INTERVAL_MS", "100"),
            ("RPC_FAILURE_TIMEOUT_MS", "900"),
        ]))
        .unwrap();
    assert_eq!(r.net.heartbeat_interval, Duration::from_millis(100));
    assert_eq!(r.net.failure_timeout, Duration::from_millis(900));
    let r = base()
        .with_heartbeat_interval(Duration::ZERO)
        .resolve_with(&env(&[("RPC_HEARTBEAT_INTERVAL_MS", "100")]))
        .unwrap();
    assert!(r.net.heartbeat_interval.is_zero(), "the config wins");
    let e = base()
        .resolve_with(&env(&[("RPC_FAILURE_TIMEOUT_MS", "soon")]))
        .unwrap_err();
    assert!(e.to_string().contains("RPC_FAILURE_TIMEOUT_MS"), "{e}");
    let e = base()
        .with_heartbeat_interval(Duration::from_secs(1))
        .with_failure_timeout(Duration::from_secs(1))
        .resolve_with(&env(&[]))
        .unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
}

#[test]
fn a_group_grows_up_to_its_maximum_or_is_dynamic_without_a_world_size() {
    let at = |rank: u32| base().with_rank(rank).with_init_method("tcp://a:1");
    let fixed = at(1).with_world_size(2).resolve_with(&env(&[])).unwrap();
    assert_eq!((fixed.size, fixed.net.capacity), (GroupSize::fixed(2), 2));
    let grows = at(5)
        .with_world_size(2)
        .resolve_with(&env(&[(MAX_WORLD_SIZE_ENV, "8")]))
        .unwrap();
    assert_eq!(
        (grows.size, grows.net.capacity),
        (GroupSize::growing(2, 8), 8)
    );
    let dynamic = at(3)
        .with_max_world_size(4)
        .resolve_with(&env(&[]))
        .unwrap();
    assert_eq!(dynamic.size, GroupSize::dynamic(4));
    assert!(
        !dynamic.serve_rendezvous
            && at(0)
                .with_max_world_size(4)
                .resolve_with(&env(&[]))
                .unwrap()
                .serve_rendezvous
    );
    let why = |c: Config| c.resolve_with(&env(&[])).unwrap_err().to_string();
    assert!(why(at(2).with_world_size(2)).contains("rank 2 is outside a group of 2"));
    assert!(why(at(8).with_world_size(2).with_max_world_size(8))
        .contains("outside a group of 2 growing to 8"));
    assert!(why(at(0).with_world_size(4).with_max_world_size(2))
        .contains("a group of 4 cannot have a capacity of 2"));
    assert!(why(at(0)).contains("for a dynamic group"));
    assert!(why(at(0).with_max_world_size(0)).contains("capacity 0"));
}

#[test]
fn restart_mode_from_config_or_env() {
    let base = || {
        base()
            .with_rank(0)
            .with_world_size(1)
            .with_init_method("tcp://a:1")
    };
    assert!(!base().resolve_with(&env(&[])).unwrap().replaced_on_failure);
    let worker = [(RESTART_MODE_ENV, "worker")];
    assert!(
        base()
            .resolve_with(&env(&worker))
            .unwrap()
            .replaced_on_failure
    );
    let group = [(RESTART_MODE_ENV, "group")];
    assert!(
        !base()
            .resolve_with(&env(&group))
            .unwrap()
            .replaced_on_failure
    );
    let r = base()
        .with_replaced_on_failure(false)
        .resolve_with(&env(&worker))
        .unwrap();
    assert!(!r.replaced_on_failure, "the config wins");
    let e = base()
        .resolve_with(&env(&[(RESTART_MODE_ENV, "node")]))
        .unwrap_err();
    assert!(e.to_string().contains(RESTART_MODE_ENV), "{e}");
}

#[test]
fn explicit_config_wins_over_env() {
    let r = base()
        .with_rank(1)
        .with_world_size(2)
        .with_init_method("tcp://localhost:7")
        .resolve_with(&env(&[("RANK", "9"), ("WORLD_SIZE", "10")]))
        .unwrap();
    assert_eq!(
        (r.net.rank, r.net.capacity, r.rendezvous.as_str()),
        (1, 2, "localhost:7")
    );
}

#[test]
fn bad_inputs_are_named() {
    let e = base()
        .resolve_with(&env(&[("RANK", "x")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("RANK") && e.contains("\"x\""), "{e}");
    let e = base()
        .with_rank(3)
        .with_world_size(3)
        .with_init_method("tcp://a:1")
        .resolve_with(&env(&[]))
        .unwrap_err();
    assert!(
        e.to_string().contains("rank 3 is outside a group of 3"),
        "{e}"
    );
    let e = base()
        .with_rank(0)
        .with_world_size(1)
        .with_init_method("http://a:1")
        .resolve_with(&env(&[]))
        .unwrap_err();
    assert!(e.to_string().contains("tcp://"), "{e}");
    let e = base()
        .with_rank(0)
        .with_world_size(1)
        .resolve_with(&env(&[]))
        .unwrap_err();
    assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
    let e = Config::new()
        .with_rank(0)
        .with_world_size(1)
        .with_init_method("tcp://a:1")
        .resolve_with(&env(&[]))
        .unwrap_err();
    assert!(e.to_string().contains("RPC_SECRET"), "{e}");
    let dir = std::env::temp_dir().join(format!("rpc-core-secret-{}", std::process::id()));
    std::fs::write(&dir, "from-file-and-long-enough\n").unwrap();
    let r = Config::new()
        .with_rank(0)
        .with_world_size(1)
        .with_init_method("tcp://a:1")
        .resolve_with(&env(&[("RPC_SECRET_FILE", dir.to_str().unwrap())]))
        .unwrap();
    std::fs::remove_file(&dir).unwrap();
    assert_eq!(r.net.secret.as_str(), Some("from-file-and-long-enough"));
    let e = Config::new()
        .with_rank(0)
        .with_world_size(1)
        .with_init_method("tcp://a:1")
        .with_secret(Secret::new("short"))
        .resolve_with(&env(&[]))
        .unwrap_err();
    assert!(e.to_string().contains("at least 16"), "{e}");
}

/// The near-miss warning comes once per node: every worker a launcher starts inherits the
/// same environment, and each of them warned (`rpcrun --nproc 3`: three copies of one warning).
/// Local rank 0 warns, once per process; a process without a launcher warns.
#[test]
fn near_misses_are_warned_of_once_per_node() {
    use super::env::warns_of_near_misses as warns;
    assert!(warns(None, true));
    assert!(warns(Some("0"), true));
    assert!(warns(Some("not a rank"), true));
    assert!(!warns(Some("1"), true));
    assert!(!warns(Some("3"), true));
    assert!(!warns(None, false));
    assert!(!warns(Some("0"), false));
}

/// A mistyped `RPC_*` variable is read by nothing; `init` warns of the ones that look like a
/// variable of ours, naming it, and leaves a program's own `RPC_*` variables alone.
#[test]
fn a_mistyped_variable_is_named_with_the_one_meant() {
    let given = [
        "RPC_FAILURE_TIMEOUT",
        "RPC_FAILURE_TIMEOUT_MS",
        "rpc_heartbeat_interval_ms",
        "RPC_SECERT",
        "RPC_SIGNALGRACE_MS",
        "RPC_MY_PROGRAMS_OWN",
        "RPC_TRACE",
        "PATH",
    ];
    assert_eq!(
        super::env::near_misses(given),
        vec![
            ("RPC_FAILURE_TIMEOUT".to_owned(), "RPC_FAILURE_TIMEOUT_MS"),
            (
                "rpc_heartbeat_interval_ms".to_owned(),
                "RPC_HEARTBEAT_INTERVAL_MS"
            ),
            ("RPC_SECERT".to_owned(), "RPC_SECRET"),
            ("RPC_SIGNALGRACE_MS".to_owned(), "RPC_SIGNAL_GRACE_MS"),
        ]
    );
}

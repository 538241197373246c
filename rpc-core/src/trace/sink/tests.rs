//! TR-9: the sink takes what a holder of the secret sends, under parts' names only.

use super::*;
use crate::trace::{part_path, Cat, Tracer, Who};

/// A fresh directory for one test's traces.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trace-sink-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes rank `rank`'s part of job `job` under `trace`, naming `sink`; returns its bytes.
fn part(trace: &Path, rank: u32, job: &str, sink: Option<String>) -> Vec<u8> {
    let t = Tracer::on(trace.to_owned(), 16);
    t.set_who(Who {
        rank,
        name: format!("w{rank}"),
        job: job.into(),
        sink,
        ..Who::default()
    });
    drop(t.span(Cat::Compute, "work"));
    let (bytes, _) = t.ring().unwrap().part_json().unwrap();
    std::fs::create_dir_all(parts_dir(trace)).unwrap();
    std::fs::write(part_path(trace, rank, 0, 0), &bytes).unwrap();
    bytes
}

#[test]
fn a_nodes_parts_reach_node_0s_directory() {
    let d = dir("reach");
    let (node0, node1) = (d.join("n0/job.json"), d.join("n1/job.json"));
    let secret = Secret::new("the group's secret");
    let sink = PartSink::start("127.0.0.1:0", secret.clone(), &node0).unwrap();
    let at = Some(sink.local_addr().to_string());
    // An earlier run's part (another job, written before) stays here.
    part(&node1, 5, "earlier", at.clone());
    std::thread::sleep(Duration::from_millis(5));
    let mine = [
        part(&node1, 1, "now", at.clone()),
        part(&node1, 2, "now", at),
    ];
    let sent = send_parts(&node1, None, "node 1", &secret, Duration::from_secs(10)).unwrap();
    assert_eq!((sent.written, sent.refused), (2, 0), "{sent:?}");
    assert_eq!(
        sink.wait_for(1, Duration::from_secs(10)),
        vec!["node 1".to_owned()]
    );
    assert_eq!(sink.files(), 2);
    for (rank, bytes) in [(1, &mine[0]), (2, &mine[1])] {
        assert_eq!(
            &std::fs::read(part_path(&node0, rank, 0, 0)).unwrap(),
            bytes
        );
    }
    assert!(!part_path(&node0, 5, 0, 0).exists());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_sender_without_the_secret_writes_nothing() {
    let d = dir("secret");
    let (node0, node1) = (d.join("n0/job.json"), d.join("n1/job.json"));
    let sink = PartSink::start("127.0.0.1:0", Secret::new("right"), &node0).unwrap();
    part(&node1, 1, "now", Some(sink.local_addr().to_string()));
    let e = send_parts(
        &node1,
        None,
        "node 1",
        &Secret::new("wrong"),
        Duration::from_secs(10),
    );
    let e = e.unwrap_err().to_string();
    assert!(e.contains("refused this node's secret"), "{e}");
    assert!(sink.wait_for(1, Duration::from_millis(300)).is_empty());
    assert!(!parts_dir(&node0).join("rank-1-inc-0.json").exists());
    let _ = std::fs::remove_dir_all(&d);
}

/// A node without parts, told where the sink is (etcd says), still says so: the sink does
/// not wait for it.
#[test]
fn a_node_without_parts_is_heard_from_when_the_sink_is_given() {
    let d = dir("empty");
    let secret = Secret::new("s");
    let sink = PartSink::start("127.0.0.1:0", secret.clone(), &d.join("n0/job.json")).unwrap();
    let at = sink.local_addr().to_string();
    let sent = send_parts(
        &d.join("n1/job.json"),
        Some(&at),
        "node 1",
        &secret,
        Duration::from_secs(10),
    );
    assert_eq!(sent.unwrap().written, 0);
    assert_eq!(
        sink.wait_for(1, Duration::from_secs(10)),
        vec!["node 1".to_owned()]
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn parts_that_name_no_sink_are_not_sent() {
    let d = dir("nosink");
    let trace = d.join("job.json");
    part(&trace, 1, "now", None);
    let e = send_parts(&trace, None, "n", &Secret::new("s"), Duration::from_secs(1)).unwrap_err();
    assert!(matches!(e, SendPartsError::NoSink(_)), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A sink that is gone, or an address that is not a sink: an error within the bound.
#[test]
fn a_missing_sink_fails_within_the_bound() {
    let d = dir("gone");
    let trace = d.join("job.json");
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let not_a_sink = other.local_addr().unwrap().to_string();
    let gone = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    part(&trace, 1, "now", Some(gone.to_string()));
    let t0 = Instant::now();
    let e = send_parts(&trace, None, "n", &Secret::new("s"), Duration::from_secs(1)).unwrap_err();
    assert!(matches!(e, SendPartsError::Io { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // A listener that speaks another protocol.
    std::thread::spawn(move || {
        let (mut c, _) = other.accept().unwrap();
        let _ = c.write_all(b"RXRPC\x00v4 and more bytes than the sink's hello has");
        std::thread::sleep(Duration::from_secs(1));
    });
    part(&trace, 1, "now", Some(not_a_sink));
    let e = send_parts(&trace, None, "n", &Secret::new("s"), Duration::from_secs(1)).unwrap_err();
    assert!(e.to_string().contains("not a trace sink"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn only_parts_names_are_written() {
    for ok in ["rank-0-inc-0.json", "rank-12-inc-3-restart-2.json"] {
        assert!(is_part_name(ok), "{ok}");
    }
    for no in [
        "../rank-0-inc-0.json",
        "rank-0-inc-0.json/x",
        "rank--inc-0.json",
        "rank-0-inc-0",
        "rank-a-inc-0.json",
        "job.json",
        "rank-0-inc-0-restart-.json",
        "rank-0-inc-0.json.tmp-1",
        "",
    ] {
        assert!(!is_part_name(no), "{no}");
    }
}

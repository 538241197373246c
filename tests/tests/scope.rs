//! A call's scope (deadline, depth, metadata) follows the tasks spawned on its behalf: by a
//! handler with `rpc_core::spawn`, and by the library's own background operations.

use std::time::Duration;

use integration_tests::*;
use rpc_core::testing::start_group;
use rpc_core::{Agent, Registry, Secret, Transport};

fn registry() -> Registry {
    collectives::install(registry_builder()).unwrap().build()
}

async fn group(n: u32, t: Transport, max_calls: usize) -> Vec<Agent> {
    start_group(
        n,
        t,
        Secret::generate(),
        |_| registry(),
        move |_, c| c.with_max_concurrent_calls(max_calls),
    )
    .await
    .expect("group starts")
}

/// A call made from a task that a handler spawned with `rpc_core::spawn` inherits the
/// handler's deadline (2 s here), not the default timeout (60 s); a bare `tokio::spawn` does
/// not, which is the trap `rpc_core::spawn` exists for.
#[test]
fn a_task_spawned_by_a_handler_keeps_the_callers_deadline() {
    each_transport(60, |t| async move {
        let a = group(3, t, 65_536).await;
        let two_s = Duration::from_secs(2);
        let scoped = a[0]
            .rpc_async_timeout(1u32, spawned_remaining_ms, (2, false), two_s)
            .await
            .unwrap()
            .expect("a deadline");
        assert!(scoped <= 2_000, "the caller's deadline: {scoped} ms left");
        let bare = a[0]
            .rpc_async_timeout(1u32, spawned_remaining_ms, (2, true), two_s)
            .await
            .unwrap()
            .expect("a deadline");
        assert!(
            bare > 2_000,
            "a bare tokio::spawn starts a root call: {bare} ms"
        );
        shutdown_all(&a).await;
    });
}

/// With one root-call permit per worker, two workers' handlers run a background all-reduce
/// between them: its messages are nested calls of the handlers (the library spawns its task
/// with the call's scope), so they need no permit and the all-reduce completes. Started as
/// root calls, each would wait for the permit the other's handler holds until the deadline.
#[test]
fn background_collectives_started_by_handlers_need_no_root_permit() {
    each_transport(60, |t| async move {
        let a = group(3, t, 1).await;
        let timeout = Duration::from_secs(10);
        let (x, y) = futures::join!(
            a[0].rpc_async_timeout(
                1u32,
                all_reduce_in_background,
                (vec![1, 2], vec![1.0, 2.0]),
                timeout
            ),
            a[0].rpc_async_timeout(
                2u32,
                all_reduce_in_background,
                (vec![1, 2], vec![10.0, 20.0]),
                timeout
            ),
        );
        assert_eq!(x.unwrap(), [11.0, 22.0]);
        assert_eq!(y.unwrap(), [11.0, 22.0]);
        shutdown_all(&a).await;
    });
}

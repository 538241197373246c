//! Who may take a rank (RDV-5): a process that holds the group's secret but not the token the
//! rendezvous issued to the live holder (which its launcher hands to the holder's
//! replacement) cannot take the rank, and the holder keeps serving; with the token, a
//! replacement takes the rank at once, before the group has declared the holder failed.
//! Before, any process with the secret and `Config::replace` evicted a live member.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use integration_tests::*;
use rpc_core::testing::{replace_token, start_group};
use rpc_core::{Config, Secret, Transport};

#[test]
fn an_impostor_with_the_secret_cannot_take_a_live_members_rank() {
    each_transport(90, |t| async move {
        let secret = Secret::generate();
        let seen = Arc::new(Mutex::new(None));
        let s2 = Arc::clone(&seen);
        let a = start_group(
            3,
            t.clone(),
            secret.clone(),
            |_| registry(),
            move |_, c| {
                *s2.lock().unwrap() = c.init_method.clone();
                c
            },
        )
        .await
        .expect("the group starts");
        let init = seen
            .lock()
            .unwrap()
            .clone()
            .expect("the rendezvous address");
        let joiner = |t: Transport, token: Option<&str>| {
            let c = Config::new()
                .with_rank(1)
                .with_world_size(3)
                .with_init_method(init.clone())
                .with_serve_rendezvous(false)
                .with_transport(t)
                .with_secret(secret.clone())
                .with_replace(true)
                .with_init_timeout(Duration::from_secs(2));
            match token {
                Some(tok) => c.with_replace_token(tok),
                None => c,
            }
        };
        for token in [None, Some("0123456789abcdef0123456789abcdef")] {
            let e = match rpc_core::init(joiner(t.clone(), token), registry()).await {
                Ok(_) => panic!("an impostor took rank 1"),
                Err(e) => e.to_string(),
            };
            assert!(
                e.contains("has not failed") && e.contains("no token"),
                "{e}"
            );
            assert!(a[0].is_live(1u32).unwrap(), "the holder was evicted");
            assert_eq!(a[0].incarnation_of(1u32).unwrap(), 0);
            assert_eq!(a[0].rpc_async(1u32, add, (1, 2)).await.unwrap(), 3);
        }
        // The holder's launcher's token: the replacement takes the rank at once.
        let token = replace_token(&a[1]);
        assert_eq!(token.len(), 32, "{token:?}");
        let b = rpc_core::init(joiner(t.clone(), Some(&token)), registry())
            .await
            .expect("the replacement with the token joins");
        assert_eq!(b.incarnation(), 1);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while a[0].incarnation_of(1u32).unwrap() != 1 {
            assert!(tokio::time::Instant::now() < deadline, "rank 0 never heard");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(a[0].rpc_async(1u32, add, (2, 2)).await.unwrap(), 4);
        // A token is good for one replacement: the new incarnation has one of its own.
        assert_ne!(replace_token(&b), token);
        let reports = futures::future::join_all(
            [&a[0], &a[2], &b].map(|x| x.shutdown_within(Duration::from_secs(5))),
        )
        .await;
        for r in &reports {
            assert!(r.aborted == 0, "{r:?}");
        }
        let _ = a[1].shutdown_within(Duration::from_secs(1)).await;
    });
}

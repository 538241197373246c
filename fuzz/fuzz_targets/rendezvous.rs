#![no_main]

libfuzzer_sys::fuzz_target!(
    init: rpc_fuzz::seed_corpus("rendezvous"),
    |data: &[u8]| rpc_core::fuzz::rendezvous(data)
);

#![no_main]

libfuzzer_sys::fuzz_target!(
    init: rpc_fuzz::seed_corpus("handshake_client"),
    |data: &[u8]| rpc_core::fuzz::handshake_client(data)
);

#![no_main]

libfuzzer_sys::fuzz_target!(
    init: rpc_fuzz::seed_corpus("tensor"),
    |data: &[u8]| autograd_dist::fuzz::tensor(data)
);

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| autograd_dist::fuzz::tensor(data));

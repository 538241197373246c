//! ALLOC-1, in a process of its own with its own `main` (the allocator's settings are the
//! process's, and must be made before any thread allocates): after `retain_freed_memory`, a
//! 64 MB buffer freed and allocated again costs no page faults, on the main thread and on a
//! thread started after it (as a runtime's are); with glibc's defaults each one is a fresh
//! mapping, 16,384 faults of 4 KiB pages (`MEM_TEST_WITHOUT=1` skips the call: it fails).

/// Minor page faults of the calling thread so far.
fn faults() -> i64 {
    // SAFETY: getrusage writes the struct it is given.
    unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut u), 0);
        u.ru_minflt
    }
}

/// The page faults of allocating and filling a 64 MB buffer (as a gradient is), then freeing
/// it, four times.
fn faults_of_64mb_buffers() -> Vec<i64> {
    (0..4)
        .map(|_| {
            let before = faults();
            let v = vec![1.0f32; 16 << 20];
            std::hint::black_box(&v);
            drop(v);
            faults() - before
        })
        .collect()
}

fn main() {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.contains("[always]") {
        // Huge pages back every large mapping: 32 faults either way, nothing to tell apart.
        println!("memory: skipped, transparent huge pages are always on here");
        return;
    }
    if std::env::var_os("MEM_TEST_WITHOUT").is_none() && !autograd_dist::retain_freed_memory() {
        println!("memory: skipped, not glibc");
        return;
    }
    let main = faults_of_64mb_buffers();
    let thread = std::thread::spawn(faults_of_64mb_buffers).join().unwrap();
    println!("page faults: main thread {main:?}, another thread {thread:?}");
    for f in [&main, &thread] {
        assert!(
            f[1..].iter().all(|&n| n < 1_000),
            "ALLOC-1: a freed buffer was not reused: {f:?} page faults"
        );
    }
    println!("memory: ok");
}

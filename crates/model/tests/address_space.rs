//! Under an address-space limit the pool and the layers' scratch leave the
//! headroom free (`headroom_model::address_space`): a pool filled until it
//! refuses leaves room for the allocations that cannot fail softly, an
//! ordinary `Vec` and a thread's stack. Before, the pool took blocks up to
//! the limit itself and the next ordinary allocation aborted the process.
//!
//! A limit binds the whole process, so the test runs itself again in a
//! child process that sets one, and checks how the child ended.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use headroom_model::memory::try_scratch;
use headroom_model::{address_space, Device, MemoryPool, ModelError, Tensor};

/// Set in the child: it is the one that works under the limit.
const CHILD: &str = "HEADROOM_ADDRESS_SPACE_CHILD";
/// What the child may map beyond what it maps when it starts.
const ROOM: u64 = 96 << 20;
const TEST: &str =
    "filling_the_pool_under_rlimit_as_leaves_the_headroom_to_what_cannot_fail_softly";

#[test]
fn filling_the_pool_under_rlimit_as_leaves_the_headroom_to_what_cannot_fail_softly() {
    if std::env::var_os(CHILD).is_some() {
        fill_the_pool_under_a_limit();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new(exe)
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("run the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.signal(), None, "the child was killed: {text}");
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("the pool refused at the headroom"),
        "the child did not run the test: {text}"
    );
}

fn fill_the_pool_under_a_limit() {
    // As `cargo xtask` runs under a limit: one malloc arena (each further
    // one reserves 64 MiB), and the compute threads started first.
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes an allocator tunable.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    rayon::join(|| (), || ());
    let limit = mapped_bytes() + ROOM;
    let value = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: setrlimit reads the struct we pass; it binds only this child.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &value) }, 0);
    let headroom = address_space::headroom();
    assert!(headroom <= ROOM / 4, "the headroom fills the test's room");

    // 1 MiB blocks until the pool is refused.
    let pool = MemoryPool::new(Device::Cpu);
    let mut held = Vec::new();
    let refusal = pool.scope(|| loop {
        match Tensor::try_zeros(&[256 << 10]) {
            Ok(block) => held.push(block),
            Err(refusal) => break refusal,
        }
    });
    assert!(
        matches!(refusal, ModelError::OutOfMemory { limit: None, .. }),
        "a refusal under no budget is the system's: {refusal}"
    );
    assert!(
        held.len() as u64 >= (ROOM - headroom) / (2 << 20),
        "{} blocks",
        held.len()
    );

    // What cannot fail softly gets the headroom: an ordinary buffer,
    // touched, and a thread (its stack and guard page).
    let room = address_space::room().expect("the limit is seen");
    let ordinary = vec![1u8; (headroom / 2) as usize];
    let sum = std::thread::spawn(move || ordinary.iter().map(|&b| u64::from(b)).sum::<u64>())
        .join()
        .expect("the thread ran");
    assert_eq!(sum, headroom / 2);
    // Left free when the pool refused: the headroom, less at most the
    // block that was refused.
    assert!(
        room + (1 << 20) >= headroom,
        "the pool left {room} bytes of a {headroom}-byte headroom"
    );

    // Scratch outside the pool keeps it too; and the room the pool gives
    // back is taken again.
    assert!(try_scratch::<f32>((headroom / 8) as usize).is_err());
    drop(held);
    pool.empty_cache();
    assert!(pool.scope(|| Tensor::try_zeros(&[256 << 10])).is_ok());
    println!("the pool refused at the headroom: {refusal}");
}

/// `VmSize` of this process, in bytes.
fn mapped_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmSize:"))
        .expect("VmSize");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("kB");
    kib << 10
}

//! SIGINT and SIGTERM: the first asks the run to stop after its step with a
//! checkpoint. A second one within `GRACE` of the first is taken as the
//! same request (`timeout` and process managers often send two at once), so
//! the checkpoint is still written; a second one after `GRACE` exits at once,
//! saying that no checkpoint was written for the current step.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// How long a second signal is treated as a repeat of the first.
pub const GRACE: Duration = Duration::from_secs(5);

pub struct StopOnSignals {
    stop: Arc<AtomicBool>,
    /// The first signal received (0: none).
    signal: Arc<AtomicI32>,
}

impl StopOnSignals {
    /// Starts the thread that watches for the signals.
    pub fn install() -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let signal = Arc::new(AtomicI32::new(0));
        let mut signals =
            Signals::new([SIGINT, SIGTERM]).context("installing the signal handlers")?;
        let (flag, first) = (Arc::clone(&stop), Arc::clone(&signal));
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                let mut since: Option<Instant> = None;
                for received in signals.forever() {
                    match since {
                        None => {
                            first.store(received, Ordering::SeqCst);
                            flag.store(true, Ordering::SeqCst);
                            since = Some(Instant::now());
                            eprintln!(
                                "{}: stopping after this step with a checkpoint (a second signal after {} s exits at once)",
                                name(received),
                                GRACE.as_secs()
                            );
                        }
                        Some(at) if at.elapsed() < GRACE => eprintln!(
                            "{} again within {} s of the first: still writing the checkpoint",
                            name(received),
                            GRACE.as_secs()
                        ),
                        Some(_) => {
                            eprintln!(
                                "{} again: exiting at once, without a checkpoint of the current step \
                                 (the last one written is intact)",
                                name(received)
                            );
                            std::process::exit(128 + first.load(Ordering::SeqCst));
                        }
                    }
                }
            })
            .context(
                "cannot start the thread that watches for SIGINT and SIGTERM: the process may start \
                 no more threads (a limit on processes and threads, ulimit -u, or on memory, \
                 ulimit -v or ulimit -d: each thread needs room for its stack)",
            )?;
        Ok(Self { stop, signal })
    }

    pub fn flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stop)
    }

    /// 128 + the signal that stopped the run, as a shell reports it.
    pub fn exit_code(&self) -> ExitCode {
        let signal = self.signal.load(Ordering::SeqCst);
        ExitCode::from(u8::try_from(128 + signal).unwrap_or(1))
    }
}

fn name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

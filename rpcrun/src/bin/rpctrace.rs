//! `rpctrace`: merges a job's trace parts into one file, and reports what held each step up.
//!
//! ```text
//! rpctrace merge job.json                  # the parts in job.json.parts/ into job.json
//! rpctrace merge job.json a.json b.json    # the given parts
//! rpctrace report job.json [--json]        # critical path, straggler, shares per worker
//! rpctrace check job.json                  # the format, and every call linked to its callee
//! rpctrace svg job.json out.svg [--first 2 --steps 3]   # a picture of three steps
//! ```

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use rpcrun::report::TraceFile;

/// Merges trace parts and reports on a merged trace.
#[derive(Parser, Debug)]
#[command(name = "rpctrace", version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Merge the parts (default: every file in TRACE.parts/) into TRACE.
    Merge {
        /// The merged trace to write.
        trace: PathBuf,
        /// The parts, if not TRACE.parts/*.json.
        parts: Vec<PathBuf>,
    },
    /// Per step: the critical path across workers, the straggler, each worker's shares.
    Report {
        /// A merged trace (or one part).
        trace: PathBuf,
        /// Print JSON (every step) instead of text (the summary).
        #[arg(long)]
        json: bool,
    },
    /// Check the format, and that every call links to its served span inside it.
    Check {
        /// A merged trace (or one part).
        trace: PathBuf,
    },
    /// Draw some steps of a trace as an SVG timeline.
    Svg {
        /// A merged trace (or one part).
        trace: PathBuf,
        /// The SVG file to write.
        out: PathBuf,
        /// The first step drawn (0-based, by start).
        #[arg(long, default_value_t = 2)]
        first: usize,
        /// How many steps.
        #[arg(long, default_value_t = 3)]
        steps: usize,
    },
}

fn main() {
    let args = Args::parse();
    let result = match args.command {
        Command::Merge { trace, parts } => {
            let parts = (!parts.is_empty()).then_some(parts);
            rpc_core::trace::merge_parts(&trace, parts.as_deref())
                .map(|s| println!("{}: {s}", trace.display()))
                .map_err(|e| e.to_string())
        }
        Command::Report { trace, json } => report(&trace, json),
        Command::Svg {
            trace,
            out,
            first,
            steps,
        } => read(&trace, |f| {
            let picture = rpcrun::report::svg(f, first, steps);
            std::fs::write(&out, picture).map_err(|e| format!("{}: {e}", out.display()))
        }),
        Command::Check { trace } => read(&trace, |f| {
            let ok = rpcrun::report::validate(f, 0.0)?;
            println!(
                "{}: valid; {} events, {} calls linked to their callee, {} without one",
                trace.display(),
                ok.events,
                ok.linked_calls,
                ok.unlinked_calls
            );
            Ok(())
        }),
    };
    if let Err(e) = result {
        eprintln!("rpctrace: error: {e}");
        std::process::exit(1);
    }
}

/// Reads the trace at `path` and runs `then` on it (its events borrow from the file's bytes).
fn read<T>(
    path: &std::path::Path,
    then: impl FnOnce(&TraceFile<'_>) -> Result<T, String>,
) -> Result<T, String> {
    let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let file = TraceFile::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    then(&file)
}

fn report(path: &std::path::Path, json: bool) -> Result<(), String> {
    let t = read(path, |f| {
        rpcrun::report::Trace::from_file(f).map_err(|e| format!("{}: {e}", path.display()))
    })?;
    let r = rpcrun::report::report(&t);
    if json {
        println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
    } else {
        print!("{}", r.text());
    }
    Ok(())
}

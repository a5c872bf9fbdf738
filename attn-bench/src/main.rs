//! `attn-bench`: the benchmark report of attn (run it through `cargo xtask bench`).
//!
//! Measures time, peak memory (counting allocator, per rank, cross-checked with RSS),
//! throughput and GFLOP/s against the machine's measured GEMM rate, for the reference,
//! CPU, ring and multihead implementations (and CUDA with the `cuda` feature), and
//! writes `target/attn-bench/<timestamp>/` with `report.md`, `results.json` and plots.
//! `--json` measures one case; `--case hilbert` alone prints the Hilbert order report.

mod backends;
mod baseline;
mod block_sparse;
mod blocks;
mod blocks_report;
mod capacity;
mod case;
mod cli;
mod cpu_runner;
#[cfg(feature = "cuda")]
mod cuda_runner;
mod feature_runner;
mod features;
mod features_report;
mod format;
mod gemm_rate;
mod hilbert_orders;
mod inputs;
mod machine;
mod measure;
mod memory;
mod multihead_runner;
mod names;
mod plots;
mod report;
mod results;
mod ring_bytes;
mod ring_runner;
mod rss_check;
mod rss_report;
mod runner;
mod single;
mod strategies;
mod strategies_report;
mod suite;
mod suite_plan;
mod torch_peer;
mod varlen_pairs;

#[global_allocator]
static ALLOC: attn_reliability::counting_alloc::CountingAlloc = attn_reliability::counting_alloc::CountingAlloc;

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match cli::parse(&args) {
        Ok(cli::Command::Help) => {
            println!("{}", cli::USAGE);
            Ok(())
        }
        Ok(cli::Command::Single { spec, runs, torch }) => {
            let obj = single::run(&spec, runs, torch.as_deref());
            println!("{obj}");
            // Our status, then (when asked for) PyTorch's: either error fails the command.
            let failed = [&obj["status"], &obj["torch"]["status"]]
                .into_iter()
                .filter_map(|s| s.as_str())
                .find(|s| s.starts_with("error"))
                .map(str::to_string);
            failed.map_or(Ok(()), |status| Err(attn_core::AttnError::InvalidArgument(status)))
        }
        Ok(cli::Command::Hilbert { reps }) => hilbert_orders::report(reps).map(|md| print!("{md}")),
        Ok(cli::Command::Suite(opts)) => suite::run(&opts),
        Ok(cli::Command::Rerender(path)) => suite::rerender(&path),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("attn-bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

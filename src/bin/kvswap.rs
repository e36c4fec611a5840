//! `kvswap`: the command-line tool.
//!
//! - `kvswap plan --context 1M`: pinned host memory, GPU memory with and
//!   without swap, and the `KVSWAP_PINNED_MIB` to set (see `kvswap::plan`).
//! - `kvswap demo`: a simulated decode loop on the library (see `kvswap::demo`).
//! - `kvswap demo --sweep`: the same over several `gpu_chunks`, with a table
//!   and an SVG plot.
//! - `kvswap fm init` / `kvswap fm info`: write a seeded random FlashMemory
//!   checkpoint / show what a checkpoint holds (see `kvswap::scorer`).
//!
//! Exit codes: 0 success, 2 usage error (bad flag, value or model file),
//! 1 runtime error (the library or the file system failed).

use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvswap::demo::{self, DemoParams, DemoReport};
use kvswap::plan::{self, fixed, thousands, tokens_short, Dtype, LayerClass, Model, ModelOverrides, PlanError, MB, MIB};
use kvswap::BackendChoice;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "kvswap",
    version,
    about = "Plan and try kvswap: host-tier KV chunks with a fixed set of GPU staging slots",
    after_help = "Start with `kvswap plan --context 1M` (the reference engine of DESIGN.md), \
                  then `kvswap demo` and `kvswap demo --sweep`.\n\
                  The commands take their settings from their flags, not from the library's \
                  KVSWAP_* settings such as KVSWAP_BACKEND or KVSWAP_GPU_CHUNKS (KVSWAP_LOG sets \
                  their log level)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Memory plan: pinned host tier, GPU KV with and without swap, KVSWAP_PINNED_MIB to set.
    Plan(PlanArgs),
    /// Simulated decode loop on the library; `--sweep` compares several gpu_chunks values.
    Demo(DemoArgs),
    /// Swap-in benchmark: on CUDA beside the bulk H2D ceiling and a per-chunk memcpy baseline.
    Bench(BenchArgs),
    /// FlashMemory scorer checkpoints: `init` writes a seeded random one, `info` shows one.
    #[command(subcommand)]
    Fm(FmCommand),
}

#[derive(Args)]
struct BenchArgs {
    /// Backend to measure (auto: CUDA when present, else the CPU).
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: i32,
    /// A shorter run (fewer sizes and rounds).
    #[arg(long)]
    quick: bool,
    /// Every GPU at once, one context and thread per GPU: swap-in and bulk
    /// H2D bandwidth per GPU, alone and concurrently (CUDA only).
    #[arg(long)]
    multi_gpu: bool,
    /// The FlashMemory scorer (score and full scopes, batched, decode step)
    /// instead of the swap-in (CUDA only).
    #[arg(long)]
    scorer: bool,
    /// Chunk sizes in bytes of the CUDA swap-in table, comma-separated (1 to
    /// 65536 each; a row of 4,096 misses pins 16,384 chunks and stages 4,096)
    /// [default: 512,2048,8192,32768; --quick 2048].
    #[arg(long, value_name = "BYTES,...", value_delimiter = ',', value_parser = chunk_bytes_arg)]
    chunk_bytes: Vec<usize>,
    /// Also write the results as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
}

fn chunk_bytes_arg(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(v) if (1..=1 << 16).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} bytes: a chunk size must be 1 to 65536 bytes")),
        Err(_) => Err(format!("{s:?} is not a whole number of bytes")),
    }
}

/// A list of layer classes, as given by `--layers 20x4,21x128`.
#[derive(Clone, Debug)]
struct Layers(Vec<LayerClass>);

#[derive(Args)]
struct PlanArgs {
    /// Context length in tokens: 8K, 256K, 1M or an integer (K = 1024, M = 1048576).
    #[arg(long, default_value = "1M", value_parser = tokens_arg, allow_negative_numbers = true)]
    context: u64,
    /// Model description (TOML), e.g. integrations/models/reference.toml; flags override it.
    #[arg(long, value_name = "FILE")]
    model: Option<PathBuf>,
    /// Layer classes as COUNTxRATIO, comma-separated [default: 20x4,21x128].
    #[arg(long, value_name = "COUNTxRATIO,...", value_parser = layers_arg)]
    layers: Option<Layers>,
    /// Elements per compressed chunk [default: 512].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    kv_dim: Option<u32>,
    /// Chunk element type: f32, f16, bf16 or fp8 [default: f32].
    #[arg(long, value_parser = dtype_arg)]
    dtype: Option<Dtype>,
    /// Sliding-window tokens kept on the GPU [default: 128].
    #[arg(long)]
    window: Option<u32>,
    /// Staging slots per layer, KVSWAP_GPU_CHUNKS [default: 512].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    gpu_chunks: Option<u32>,
    /// GPU bytes of indexer keys per token [default: 5376 = 21 layers x 128-dim bf16].
    #[arg(long, value_name = "BYTES")]
    indexer_bytes_per_token: Option<u64>,
    /// GPU bytes of the scorer weights [default: 500000000].
    #[arg(long, value_name = "BYTES")]
    scorer_weight_bytes: Option<u64>,
    /// Print the plan as JSON instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum BackendArg {
    /// CUDA when a driver and a device are present, else the CPU backend.
    Auto,
    /// Host memory plays the device.
    Cpu,
    /// CUDA; fails (exit 1) when no device or no CUDA build is available.
    Cuda,
}

impl From<BackendArg> for BackendChoice {
    fn from(b: BackendArg) -> BackendChoice {
        match b {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Cpu => BackendChoice::Cpu,
            BackendArg::Cuda => BackendChoice::Cuda,
        }
    }
}

#[derive(Args)]
struct DemoArgs {
    /// Tokens of context before decode starts (K = 1024, M = 1048576).
    #[arg(long, default_value = "256K", value_parser = tokens_arg, allow_negative_numbers = true)]
    context: u64,
    /// Tokens per compressed chunk.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    ratio: u32,
    /// Number of sparse layers (all at --ratio).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    layers: u32,
    /// f32 elements per chunk (chunk bytes = 4 x kv_dim).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    kv_dim: u32,
    /// Staging slots per layer.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    gpu_chunks: u32,
    /// Chunks selected per step (one global top-k shared by all layers).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    topk: u32,
    /// Decode steps (one token each).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Fraction of the previous step's selection kept, in [0, 1].
    #[arg(long, default_value_t = 0.8, value_parser = fraction_arg)]
    locality: f64,
    /// Fraction of fresh picks from the --recent-chunks newest chunks (the rest: uniform over history), in [0, 1].
    #[arg(long, default_value_t = 0.25, value_parser = fraction_arg)]
    recent_frac: f64,
    /// How many of the newest chunks count as recent.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    recent_chunks: u32,
    /// Seed of the selection sequence.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Sliding-window tokens.
    #[arg(long, default_value_t = 128)]
    window: u32,
    /// Backend of the context.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Run once per --sweep-chunks value and print the comparison table.
    #[arg(long)]
    sweep: bool,
    /// gpu_chunks values of the sweep (implies --sweep) [default: 512,1024,2048,4096,8192, those >= --topk].
    #[arg(long, value_delimiter = ',', value_name = "N,N,...", value_parser = clap::value_parser!(u32).range(1..))]
    sweep_chunks: Vec<u32>,
    /// Where the sweep writes its plot [default: kvswap-sweep.svg].
    #[arg(long, value_name = "PATH")]
    svg: Option<PathBuf>,
    /// Also write the results as JSON to PATH (a sweep: `params` with the swept `sweep_chunks`, one result per run).
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Show the library's info log lines (KVSWAP_LOG, when set, wins).
    #[arg(long, short)]
    verbose: bool,
}

const DEFAULT_SWEEP_CHUNKS: [u32; 5] = [512, 1024, 2048, 4096, 8192];

/// Why the program stops: a usage error (exit 2) or a runtime error (exit 1).
enum Failure {
    Usage(String),
    Runtime(String),
}

impl From<PlanError> for Failure {
    fn from(e: PlanError) -> Failure {
        Failure::Usage(e.to_string())
    }
}

impl From<kvswap::Error> for Failure {
    fn from(e: kvswap::Error) -> Failure {
        Failure::Runtime(e.to_string())
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(a) => cmd_plan(a),
        Command::Demo(a) => cmd_demo(a),
        Command::Bench(a) => cmd_bench(a),
        Command::Fm(c) => cmd_fm(c),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(m)) => {
            eprintln!("kvswap: error: {m}");
            eprintln!("For more information, try '--help'.");
            ExitCode::from(2)
        }
        Err(Failure::Runtime(m)) => {
            eprintln!("kvswap: error: {m}");
            ExitCode::from(1)
        }
    }
}

// ------------------------------------------------------------ bench

fn cmd_bench(a: BenchArgs) -> Result<(), Failure> {
    kvswap::logging::init();
    if !kvswap::logging::level_from_env_set() {
        log::set_max_level(log::LevelFilter::Warn);
    }
    let backend: BackendChoice = a.backend.into();
    if let Some(path) = &a.json {
        check_output_path("--json", path)?;
    }
    if backend == BackendChoice::Cpu && a.device != 0 {
        return Err(Failure::Usage(format!("--device {} picks a CUDA device: it does not apply to --backend cpu", a.device)));
    }
    if a.scorer && a.multi_gpu {
        return Err(Failure::Usage("--scorer and --multi-gpu are two benchmarks: give one".into()));
    }
    if a.multi_gpu && a.device != 0 {
        return Err(Failure::Usage(format!("--device {} picks one GPU: --multi-gpu measures every GPU", a.device)));
    }
    if !a.chunk_bytes.is_empty() && (a.scorer || a.multi_gpu || backend == BackendChoice::Cpu) {
        return Err(Failure::Usage("--chunk-bytes sizes the CUDA swap-in table: not with --scorer, --multi-gpu or --backend cpu".into()));
    }
    #[cfg(not(feature = "cuda"))]
    if a.scorer || a.multi_gpu {
        return Err(Failure::Runtime(format!(
            "{} measures the CUDA backend, which this build does not have (feature `cuda` off)",
            if a.scorer { "--scorer" } else { "--multi-gpu" }
        )));
    }
    #[cfg(feature = "cuda")]
    if a.scorer {
        if backend == BackendChoice::Cpu {
            return Err(Failure::Usage("--scorer measures the CUDA scorer: use --backend cuda or auto".into()));
        }
        let r = kvswap::gpubench::run_fm(a.device, a.quick)?;
        emit(&kvswap::gpubench::render_fm(&r))?;
        if let Some(path) = &a.json {
            write_file(path, &to_json(&r)?)?;
            emit(&format!("wrote {}\n", path.display()))?;
        }
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if a.multi_gpu {
        if backend == BackendChoice::Cpu {
            return Err(Failure::Usage("--multi-gpu measures GPUs: use --backend cuda or auto".into()));
        }
        let r = kvswap::gpubench::run_multi(a.quick)?;
        emit(&kvswap::gpubench::render_multi(&r))?;
        if let Some(path) = &a.json {
            write_file(path, &to_json(&r)?)?;
            emit(&format!("wrote {}\n", path.display()))?;
        }
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if backend != BackendChoice::Cpu {
        let sizes = (!a.chunk_bytes.is_empty()).then_some(a.chunk_bytes.as_slice());
        match kvswap::gpubench::run(a.device, a.quick, sizes) {
            Ok(r) => {
                emit(&kvswap::gpubench::render(&r))?;
                if let Some(path) = &a.json {
                    write_file(path, &to_json(&r)?)?;
                    emit(&format!("wrote {}\n", path.display()))?;
                }
                return Ok(());
            }
            Err(e) if backend == BackendChoice::Auto && kvswap::backend::cuda_device_count().is_none() => {
                if !a.chunk_bytes.is_empty() {
                    return Err(Failure::Runtime(format!("--chunk-bytes sizes the CUDA swap-in table, and there is no CUDA device ({})", e.message)));
                }
                emit(&format!("note: no CUDA device ({}); measuring the CPU backend\n\n", e.message))?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    #[cfg(not(feature = "cuda"))]
    if backend == BackendChoice::Cuda {
        return Err(Failure::Runtime("this build has no CUDA backend (feature `cuda` off)".into()));
    }
    if !a.chunk_bytes.is_empty() {
        return Err(Failure::Runtime("--chunk-bytes sizes the CUDA swap-in table, which this build does not have (feature `cuda` off)".into()));
    }
    let rows = kvswap::demo::cpu_swap_bench(a.quick)?;
    emit(&kvswap::demo::render_cpu_swap_bench(&rows))?;
    if let Some(path) = &a.json {
        write_file(path, &to_json(&rows)?)?;
        emit(&format!("wrote {}\n", path.display()))?;
    }
    Ok(())
}

// ------------------------------------------------------------ value parsers

fn tokens_arg(s: &str) -> Result<u64, String> {
    plan::parse_tokens("--context", s).map_err(|e| e.reason)
}

fn layers_arg(s: &str) -> Result<Layers, String> {
    plan::parse_layers(s).map(Layers).map_err(|e| e.reason)
}

fn dtype_arg(s: &str) -> Result<Dtype, String> {
    Dtype::parse(s).ok_or_else(|| "unknown dtype: expected f32, f16, bf16 or fp8".to_string())
}

fn fraction_arg(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err("expected a number in [0, 1]".to_string()),
    }
}

// ------------------------------------------------------------ output helpers

/// Writes to stdout; a closed pipe (`kvswap plan | head`) is not an error.
fn emit(text: &str) -> Result<(), Failure> {
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(Failure::Runtime(format!("writing to stdout: {e}")))
        }
        _ => Ok(()),
    }
}

/// Refuses an output path that cannot be written (no such folder, a folder
/// itself, no permission) before the work that would write it, rather than
/// after: an existing file is opened for appending (nothing truncated), a
/// new one is created and removed again.
fn check_output_path(flag: &str, path: &Path) -> Result<(), Failure> {
    let refuse = |why: String| Err(Failure::Usage(format!("{flag} {}: {why}", path.display())));
    if path.is_dir() || path.as_os_str().to_string_lossy().ends_with('/') {
        return refuse("is a directory; give a file path".into());
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return refuse(format!("{} is not a folder", parent.display()));
    }
    let opened = if path.exists() {
        // A FIFO or device is written when the run ends, not opened here:
        // opening a FIFO blocks for a reader, and closing it would end the
        // reader's input before the real write.
        if !path.metadata().is_ok_and(|m| m.is_file()) {
            return Ok(());
        }
        std::fs::OpenOptions::new().append(true).open(path).map(drop)
    } else {
        std::fs::OpenOptions::new().write(true).create_new(true).open(path).and_then(|f| {
            drop(f);
            std::fs::remove_file(path)
        })
    };
    opened.or_else(|e| refuse(format!("cannot write it: {e}")))
}

fn write_file(path: &Path, text: &str) -> Result<(), Failure> {
    std::fs::write(path, text).map_err(|e| Failure::Runtime(format!("cannot write {}: {e}", path.display())))
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, Failure> {
    serde_json::to_string_pretty(v).map(|s| s + "\n").map_err(|e| Failure::Runtime(format!("JSON: {e}")))
}

fn mib(bytes: u64) -> String {
    fixed(bytes as f64 / MIB as f64, 2)
}

fn mb_mib(bytes: u64) -> String {
    format!("{} MB ({} MiB)", fixed(bytes as f64 / MB, 2), mib(bytes))
}

/// `409600` -> `"409,600 B (400.0 KiB)"`.
fn bytes_kib(bytes: f64) -> String {
    format!("{} B ({} KiB)", thousands(bytes.round() as u64), fixed(bytes / 1024.0, 1))
}

// ------------------------------------------------------------ plan

/// Defaults, then the model file, then the flags.
fn plan_model(a: &PlanArgs) -> Result<Model, Failure> {
    let mut m = match &a.model {
        Some(path) => Model::from_toml_file(path)?,
        None => Model::default(),
    };
    ModelOverrides {
        layers: a.layers.as_ref().map(|Layers(l)| l.clone()),
        kv_dim: a.kv_dim,
        dtype: a.dtype,
        window: a.window,
        gpu_chunks: a.gpu_chunks,
        indexer_bytes_per_token: a.indexer_bytes_per_token,
        scorer_weight_bytes: a.scorer_weight_bytes,
    }
    .apply_to(&mut m);
    Ok(m)
}

fn cmd_plan(a: PlanArgs) -> Result<(), Failure> {
    let model = plan_model(&a)?;
    let p = plan::plan(&model, a.context)?;
    // Pinned memory cannot be paged out: a host tier above this machine's
    // memory is a plan for another machine (a note on stderr; stdout stays
    // the plan).
    if let Some(total) = host_memory_bytes().filter(|&t| p.pinned_bytes_total > t) {
        eprintln!(
            "note: the pinned host tier ({} GB) is more than this machine's memory ({} GB); pinned memory cannot be paged out",
            fixed(p.pinned_bytes_total as f64 / 1e9, 1),
            fixed(total as f64 / 1e9, 1)
        );
    }
    if a.json {
        emit(&to_json(&p)?)
    } else {
        emit(&plan::render(&p))
    }
}

/// This machine's memory (`MemTotal` of /proc/meminfo), where it can be read.
fn host_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    Some(kib * 1024)
}

// ------------------------------------------------------------ demo

fn demo_params(a: &DemoArgs, gpu_chunks: u32) -> Result<DemoParams, Failure> {
    let p = DemoParams {
        context: a.context,
        ratio: a.ratio,
        layers: a.layers,
        kv_dim: a.kv_dim,
        gpu_chunks,
        topk: a.topk,
        steps: a.steps,
        locality: a.locality,
        recent_frac: a.recent_frac,
        recent_chunks: a.recent_chunks,
        seed: a.seed,
        window: a.window,
        backend: a.backend.into(),
    };
    p.validate()?;
    Ok(p)
}

/// Library logs: warnings only, unless `--verbose` or `KVSWAP_LOG` says otherwise.
fn set_log_level(verbose: bool) {
    if !kvswap::logging::level_from_env_set() {
        kvswap::logging::set_level(if verbose { 3 } else { 2 });
    }
}

/// A progress bar on stderr for long runs in a terminal; `None` otherwise.
fn progress_bar(total: u64, steps_per_run: u64) -> Option<ProgressBar> {
    if steps_per_run < 1000 || !std::io::stderr().is_terminal() {
        return None;
    }
    let style = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} steps, eta {eta}")
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    let pb = ProgressBar::new(total);
    pb.set_style(style);
    pb.set_message("prefill");
    Some(pb)
}

/// Moves the bar to `pos`; at the first decode step of a run (`step == 1`)
/// names the run and restarts the estimate, which prefill would skew.
fn advance(pb: &Option<ProgressBar>, pos: u64, step: u64, gpu_chunks: u32) {
    if let Some(pb) = pb {
        if step == 1 {
            pb.set_message(format!("decode, gpu_chunks={gpu_chunks}"));
            pb.reset_eta();
        }
        pb.set_position(pos);
    }
}

fn cmd_demo(a: DemoArgs) -> Result<(), Failure> {
    set_log_level(a.verbose);
    for (flag, path) in [("--svg", &a.svg), ("--json", &a.json)] {
        if let Some(path) = path {
            check_output_path(flag, path)?;
        }
    }
    if a.sweep || !a.sweep_chunks.is_empty() {
        // The runs take their gpu_chunks from the list (the default list
        // without values below --topk), not from --gpu-chunks.
        let chunks: Vec<u32> = if a.sweep_chunks.is_empty() {
            DEFAULT_SWEEP_CHUNKS.iter().copied().filter(|&c| c >= a.topk).collect()
        } else {
            a.sweep_chunks.clone()
        };
        if let Some(&c) = chunks.iter().find(|&&c| c < a.topk) {
            return Err(Failure::Usage(format!(
                "invalid --sweep-chunks value \"{c}\": every selected chunk needs a slot, values must be >= --topk={}",
                a.topk
            )));
        }
        // Every run's settings are checked; the largest run's stand for the sweep.
        let runs = chunks.iter().map(|&c| demo_params(&a, c)).collect::<Result<Vec<_>, _>>()?;
        let Some(p) = runs.into_iter().max_by_key(|r| r.gpu_chunks) else {
            return Err(Failure::Usage(format!("no value of the default sweep is >= --topk={}: give --sweep-chunks", a.topk)));
        };
        return cmd_sweep(&a, &p, &chunks);
    }
    if a.svg.is_some() {
        return Err(Failure::Usage("--svg is the sweep's plot: it needs --sweep or --sweep-chunks".into()));
    }
    let p = demo_params(&a, a.gpu_chunks)?;
    let pb = progress_bar(p.steps, p.steps);
    let r = demo::run(&p, &mut |s| advance(&pb, s, s, p.gpu_chunks));
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    let r = r.map_err(|e| runtime_error(&p, e))?;
    emit(&render_demo(&p, &r))?;
    if let Some(path) = &a.json {
        write_file(path, &to_json(&serde_json::json!({ "params": p, "result": r }))?)?;
        emit(&format!("wrote {}\n", path.display()))?;
    }
    Ok(())
}

/// A library error, with a hint when an explicit `--backend cuda` cannot run.
fn runtime_error(p: &DemoParams, e: kvswap::Error) -> Failure {
    let hint = match (e.status, p.backend) {
        (kvswap::KvswapStatus::NoDevice, BackendChoice::Cuda) => {
            "--backend cuda was asked for explicitly, so the demo does not fall back; \
             use --backend cpu (or auto, which falls back to the CPU with a note where the driver reports no device)"
        }
        _ => return e.into(),
    };
    Failure::Runtime(format!("{e}\n  {hint}"))
}

fn render_setup(p: &DemoParams, r: &DemoReport) -> String {
    let new_chunks = (p.context + p.steps) / p.ratio as u64 - p.initial_chunks();
    let mut s = format!("kvswap demo: simulated decode, backend {}\n", r.backend_description);
    if let Some(note) = &r.note {
        s += &format!("  note: {note}\n");
    }
    s += &format!(
        "  model:     {} layers at ratio {}, kv_dim {} x f32 = {} B per chunk, window {}\n\
         \x20 context:   {} tokens ({}) = {} chunks per layer; {} decode steps add {} chunks\n\
         \x20 swap:      gpu_chunks {} slots per layer, top-k {} (one global selection shared by all layers)\n\
         \x20 selection: keep {}% of the previous step's chunks; fresh picks {}% from the {} newest chunks, \
         the rest uniform over the history; seed {}\n\
         \x20 prefill:   {} chunk stores in {} s\n",
        p.layers,
        p.ratio,
        p.kv_dim,
        thousands(p.kv_dim as u64 * 4),
        p.window,
        thousands(p.context),
        tokens_short(p.context),
        thousands(p.initial_chunks()),
        thousands(p.steps),
        thousands(new_chunks),
        p.gpu_chunks,
        p.topk,
        fixed(p.locality * 100.0, 0),
        fixed(p.recent_frac * 100.0, 0),
        thousands(p.recent_chunks as u64),
        p.seed,
        thousands(r.prefill_chunks),
        fixed(r.prefill_s, 3),
    );
    s
}

fn render_demo(p: &DemoParams, r: &DemoReport) -> String {
    let mut s = render_setup(p, r);
    s += &format!(
        "\nresults over {} decode steps (timed: store of new chunks + swap-in of every layer)\n\
         \x20 step time:      mean {} us, p50 {} us, p99 {} us\n\
         \x20 throughput:     {} steps/s\n\
         \x20 hit rate:       {}% (hits {}, misses {}, evictions {})\n\
         \x20 moved per step: h2d {}, d2h {} (all {} layers)\n",
        thousands(r.steps),
        fixed(r.step_us_mean, 1),
        fixed(r.step_us_p50, 1),
        fixed(r.step_us_p99, 1),
        fixed(r.steps_per_s, 0),
        fixed(r.hit_rate * 100.0, 2),
        thousands(r.hits),
        thousands(r.misses),
        thousands(r.evictions),
        bytes_kib(r.h2d_bytes_per_step),
        bytes_kib(r.d2h_bytes_per_step),
        p.layers,
    );
    s += &format!(
        "\nGPU memory of these {} layers at {} tokens (as `kvswap plan` counts it):\n\
         \x20 KV without swap {}, with swap {}; pinned host tier {}\n",
        p.layers,
        thousands(p.context),
        mb_mib(r.gpu_bytes_no_swap),
        mb_mib(r.gpu_bytes_swap),
        mb_mib(r.pinned_bytes),
    );
    s
}

fn cmd_sweep(a: &DemoArgs, p: &DemoParams, chunks: &[u32]) -> Result<(), Failure> {
    let pb = progress_bar(p.steps * chunks.len() as u64, p.steps);
    let reports = demo::sweep(p, chunks, &mut |i, s| advance(&pb, i as u64 * p.steps + s, s, chunks[i]));
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    let reports = reports.map_err(|e| runtime_error(p, e))?;
    emit(&render_sweep(p, &reports))?;
    let svg_path = a.svg.clone().unwrap_or_else(|| PathBuf::from("kvswap-sweep.svg"));
    write_file(&svg_path, &demo::sweep_chart(p, &reports).to_svg())?;
    emit(&format!("\nwrote {}\n", svg_path.display()))?;
    if let Some(path) = &a.json {
        let no_swap = reports.first().map_or(0, |r| r.gpu_bytes_no_swap);
        // The runs' shared settings: gpu_chunks differs per run (each
        // result has its own), so the params give the swept list instead of
        // the largest run's value.
        let mut params = serde_json::to_value(p).map_err(|e| Failure::Runtime(format!("JSON: {e}")))?;
        if let Some(obj) = params.as_object_mut() {
            obj.remove("gpu_chunks");
            obj.insert("sweep_chunks".into(), serde_json::json!(chunks));
        }
        write_file(
            path,
            &to_json(&serde_json::json!({ "params": params, "gpu_bytes_no_swap": no_swap, "results": reports }))?,
        )?;
        emit(&format!("wrote {}\n", path.display()))?;
    }
    Ok(())
}

fn render_sweep(p: &DemoParams, reports: &[DemoReport]) -> String {
    let backend = reports.first().map_or("?", |r| r.backend.as_str());
    let mut s = format!(
        "kvswap demo --sweep: {} layers at ratio {}, context {} tokens ({}), {} steps per run, top-k {}, \
         locality {}, {} backend\n",
        p.layers,
        p.ratio,
        thousands(p.context),
        tokens_short(p.context),
        thousands(p.steps),
        p.topk,
        p.locality,
        backend
    );
    if let Some(note) = reports.first().and_then(|r| r.note.as_ref()) {
        s += &format!("note: {note}\n");
    }
    if let Some(r) = reports.first() {
        s += &format!(
            "GPU KV without swap: {} MiB; pinned host tier: {} MiB\n",
            mib(r.gpu_bytes_no_swap),
            mib(r.pinned_bytes)
        );
    }
    s += &format!(
        "\n  {:>10}  {:>14}  {:>8}  {:>9}  {:>10}  {:>11}\n",
        "gpu_chunks", "GPU MiB (swap)", "hit rate", "steps/s", "p99 us", "h2d B/step"
    );
    for r in reports {
        s += &format!(
            "  {:>10}  {:>14}  {:>7}%  {:>9}  {:>10}  {:>11}\n",
            r.gpu_chunks,
            mib(r.gpu_bytes_swap),
            fixed(r.hit_rate * 100.0, 2),
            fixed(r.steps_per_s, 0),
            fixed(r.step_us_p99, 1),
            thousands(r.h2d_bytes_per_step.round() as u64),
        );
    }
    s
}

// ------------------------------------------------------------ fm

#[derive(Subcommand)]
enum FmCommand {
    /// Write a seeded random `flashmemory-v1` checkpoint (weights ~ N(0, 1/hidden), so scores are O(1)).
    Init(FmInitArgs),
    /// Print what a checkpoint holds: metadata, tensors with shapes and dtypes, size, weight statistics.
    Info(FmInfoArgs),
}

#[derive(Args)]
struct FmInitArgs {
    /// Width of each scorer's hidden input.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    hidden: u32,
    /// Heads per scorer.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    heads: u32,
    /// Elements per head (and per indexer key).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=4096))]
    head_dim: u32,
    /// Scorer heads (the reference engine takes 3, at layers 10/12/20).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=64))]
    scorers: u32,
    /// Where to write the checkpoint.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Weight element type.
    #[arg(long, value_enum, default_value_t = FmDtypeArg::Bf16)]
    dtype: FmDtypeArg,
    /// How the scorers are combined unless an engine overrides it.
    #[arg(long, value_enum, default_value_t = FmEnsembleArg::Max)]
    ensemble: FmEnsembleArg,
    /// Seed of the weights: the same seed writes the same weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Args)]
struct FmInfoArgs {
    /// The checkpoint (safetensors).
    file: PathBuf,
    /// Print the information as JSON instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FmDtypeArg {
    F32,
    F16,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FmEnsembleArg {
    Max,
    Mean,
}

fn cmd_fm(c: FmCommand) -> Result<(), Failure> {
    match c {
        FmCommand::Init(a) => cmd_fm_init(a),
        FmCommand::Info(a) => cmd_fm_info(a),
    }
}

fn cmd_fm_init(a: FmInitArgs) -> Result<(), Failure> {
    use kvswap::scorer::{write, Meta, WeightDtype};
    let meta = Meta {
        n_scorers: a.scorers,
        hidden: a.hidden,
        n_heads: a.heads,
        head_dim: a.head_dim,
        ensemble: match a.ensemble {
            FmEnsembleArg::Max => kvswap::Ensemble::Max,
            FmEnsembleArg::Mean => kvswap::Ensemble::Mean,
        },
    };
    let dtype = match a.dtype {
        FmDtypeArg::F32 => WeightDtype::F32,
        FmDtypeArg::F16 => WeightDtype::F16,
        FmDtypeArg::Bf16 => WeightDtype::Bf16,
    };
    let tensors = write::random(&meta, dtype, a.seed).map_err(|e| Failure::Usage(e.message))?;
    write::save(&a.out, &meta, &tensors)?;
    let weight_bytes: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    emit(&format!(
        "wrote {}: {} scorer{}, hidden {}, {} heads x {} dims, {} weights, {}, ensemble {}, seed {}\n",
        a.out.display(),
        meta.n_scorers,
        if meta.n_scorers == 1 { "" } else { "s" },
        meta.hidden,
        meta.n_heads,
        meta.head_dim,
        dtype.name(),
        mb_mib(weight_bytes),
        kvswap::scorer::ensemble_name(meta.ensemble),
        a.seed
    ))
}

fn cmd_fm_info(a: FmInfoArgs) -> Result<(), Failure> {
    let ckpt = kvswap::scorer::Checkpoint::load(&a.file)?;
    let info = kvswap::scorer::info::info(&ckpt);
    if a.json {
        emit(&to_json(&info)?)
    } else {
        emit(&kvswap::scorer::info::render(&a.file.display().to_string(), &info))
    }
}

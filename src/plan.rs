//! Memory planner behind `kvswap plan`: for a model and a context length,
//! how much pinned host memory the host tier needs, how much GPU memory the
//! KV cache takes with and without swap, and what `KVSWAP_PINNED_MIB` to set.
//!
//! Everything here is a pure function of a [`Model`] and a context length, so
//! the figures of DESIGN.md ("Reference configuration") are unit tests.
//!
//! Units: `MB` and `GB` are decimal (1e6, 1e9 bytes), as DESIGN.md writes its
//! figures; `MiB` is 2^20 bytes, the unit of `KVSWAP_PINNED_MIB`.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::Path;

/// Most layers a model may have in all (their counts are summed in u32).
const MAX_LAYERS: u64 = 1 << 20;

/// Largest model file `--model` reads.
const MODEL_FILE_MAX: u64 = 1 << 20;

// `cbindgen:ignore` keeps these Rust-only constants out of include/kvswap.h.

/// Decimal megabyte, the unit of DESIGN.md's tables.
/// cbindgen:ignore
pub const MB: f64 = 1e6;
/// Decimal gigabyte.
/// cbindgen:ignore
pub const GB: f64 = 1e9;
/// Binary mebibyte, the unit of `KVSWAP_PINNED_MIB`.
/// cbindgen:ignore
pub const MIB: u64 = 1 << 20;
/// The smallest `KVSWAP_PINNED_MIB` the planner suggests.
/// cbindgen:ignore
pub const MIN_SUGGESTED_PINNED_MIB: u64 = 256;

/// A planner input that cannot be used: which flag or field, the value, why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanError {
    /// The flag or file field, for example `--layers` or `layers[1].ratio`.
    pub what: String,
    /// The offending value as the user wrote it.
    pub value: String,
    /// What was expected.
    pub reason: String,
}

impl PlanError {
    pub fn new(what: impl Into<String>, value: impl fmt::Display, reason: impl Into<String>) -> PlanError {
        PlanError { what: what.into(), value: value.to_string(), reason: reason.into() }
    }
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {} value {:?}: {}", self.what, self.value, self.reason)
    }
}

impl std::error::Error for PlanError {}

/// Element type of a KV chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Dtype {
    F32,
    F16,
    Bf16,
    Fp8,
}

impl Dtype {
    /// Bytes of one element.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::Fp8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        }
    }

    /// Parses `f32`, `f16`, `bf16`, `fp8` (case-insensitive; `fp32`, `fp16`,
    /// `float32`, `half`, `e4m3` are accepted too).
    pub fn parse(s: &str) -> Option<Dtype> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Some(Dtype::F32),
            "f16" | "fp16" | "float16" | "half" => Some(Dtype::F16),
            "bf16" | "bfloat16" => Some(Dtype::Bf16),
            "fp8" | "f8" | "e4m3" | "fp8_e4m3" => Some(Dtype::Fp8),
            _ => None,
        }
    }
}

impl TryFrom<String> for Dtype {
    type Error = String;
    fn try_from(s: String) -> Result<Dtype, String> {
        Dtype::parse(&s).ok_or_else(|| format!("unknown dtype {s:?}: expected f32, f16, bf16 or fp8"))
    }
}

impl From<Dtype> for String {
    fn from(d: Dtype) -> String {
        d.name().to_string()
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `count` layers that compress the context by `ratio` (one compressed chunk
/// per `ratio` tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerClass {
    pub count: u32,
    pub ratio: u32,
}

/// What the planner needs to know about a model and its kvswap settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// Sparse layers, grouped by compression ratio.
    pub layers: Vec<LayerClass>,
    /// Elements of one compressed chunk (K and V together as the engine stores them).
    pub kv_dim: u32,
    /// Element type of a chunk.
    pub dtype: Dtype,
    /// Sliding-window tokens kept on the GPU besides the selected chunks (`KVSWAP_WINDOW`).
    pub window: u32,
    /// Staging slots per layer (`KVSWAP_GPU_CHUNKS`).
    pub gpu_chunks: u32,
    /// GPU bytes of indexer (scorer) keys per token of context. The default,
    /// 5376 = 21 layers x 128-dim bf16 key per token, reproduces the reference
    /// engine's 5.6 GB of indexer keys at 1M context.
    pub indexer_bytes_per_token: u64,
    /// GPU bytes of the scorer's weights; default 500,000,000, the reference
    /// engine's "0.5 GB".
    pub scorer_weight_bytes: u64,
}

impl Default for Model {
    /// The reference engine of DESIGN.md: 20 layers at ratio 4 and 21 at
    /// ratio 128, kv_dim 512, f32 chunks, window 128, 512 slots.
    fn default() -> Model {
        Model {
            layers: vec![LayerClass { count: 20, ratio: 4 }, LayerClass { count: 21, ratio: 128 }],
            kv_dim: 512,
            dtype: Dtype::F32,
            window: 128,
            gpu_chunks: 512,
            indexer_bytes_per_token: 21 * 128 * 2,
            scorer_weight_bytes: 500_000_000,
        }
    }
}

impl Model {
    /// Bytes of one compressed chunk.
    pub fn chunk_bytes(&self) -> u64 {
        self.kv_dim as u64 * self.dtype.bytes()
    }

    /// Checks values that make no plan; errors name the command-line flag.
    pub fn validate(&self) -> Result<(), PlanError> {
        self.check(|flag, _field| flag.to_string())
    }

    /// Checks values that make no plan; errors name the field of a model file.
    fn validate_file(&self) -> Result<(), PlanError> {
        self.check(|_flag, field| field)
    }

    /// `name(flag, file_field)` says how an error names the value.
    fn check(&self, name: impl Fn(&str, String) -> String) -> Result<(), PlanError> {
        if self.layers.is_empty() {
            return Err(PlanError::new(name("--layers", "layers".into()), "[]", "at least one layer class is needed"));
        }
        for (i, c) in self.layers.iter().enumerate() {
            if c.count == 0 {
                return Err(PlanError::new(name("--layers", format!("layers[{i}].count")), c.count, "must be >= 1"));
            }
            if c.ratio == 0 {
                return Err(PlanError::new(name("--layers", format!("layers[{i}].ratio")), c.ratio, "must be >= 1"));
            }
        }
        // Layer counts are summed in u32 (a model has thousands at most).
        let total: u64 = self.layers.iter().map(|c| c.count as u64).sum();
        if total > MAX_LAYERS {
            return Err(PlanError::new(name("--layers", "layers".into()), total, format!("at most {MAX_LAYERS} layers in all")));
        }
        if self.kv_dim == 0 {
            return Err(PlanError::new(name("--kv-dim", "kv_dim".into()), self.kv_dim, "must be >= 1"));
        }
        if self.gpu_chunks == 0 {
            return Err(PlanError::new(name("--gpu-chunks", "gpu_chunks".into()), self.gpu_chunks, "must be >= 1"));
        }
        Ok(())
    }

    /// Loads a model file (TOML, see `integrations/models/reference.toml`).
    /// Fields left out keep the reference engine's values.
    pub fn from_toml_file(path: &Path) -> Result<Model, PlanError> {
        let refuse = |why: String| PlanError::new("--model", path.display(), why);
        // A model file is a few lines: refuse devices, pipes and big files
        // instead of reading them without end (`--model /dev/zero`).
        let meta = std::fs::metadata(path).map_err(|e| refuse(format!("cannot read the file: {e}")))?;
        if !meta.is_file() || meta.len() > MODEL_FILE_MAX {
            return Err(refuse(format!("not a model file: expected a regular file of at most {MODEL_FILE_MAX} bytes")));
        }
        let text = std::fs::read_to_string(path).map_err(|e| refuse(format!("cannot read the file: {e}")))?;
        Model::from_toml_str(&text).map_err(|e| match e.what.as_str() {
            "--model" => PlanError { value: path.display().to_string(), ..e },
            _ => PlanError { what: format!("{} in {}", e.what, path.display()), ..e },
        })
    }

    /// Parses a model description in TOML (every field optional). Errors
    /// name the field (`layers[1].ratio`).
    pub fn from_toml_str(text: &str) -> Result<Model, PlanError> {
        let file: ModelOverrides = toml::from_str(text).map_err(|e| {
            PlanError::new("--model", "<text>", format!("not a valid model file: {}", e.to_string().trim_end()))
        })?;
        let mut m = Model::default();
        file.apply_to(&mut m);
        m.validate_file()?;
        Ok(m)
    }
}

/// Changes to a model: a model file as written, or the `kvswap plan` flags.
/// Every field optional (left out: unchanged); in a file, unknown fields are
/// refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelOverrides {
    pub layers: Option<Vec<LayerClass>>,
    pub kv_dim: Option<u32>,
    pub dtype: Option<Dtype>,
    pub window: Option<u32>,
    pub gpu_chunks: Option<u32>,
    pub indexer_bytes_per_token: Option<u64>,
    pub scorer_weight_bytes: Option<u64>,
}

impl ModelOverrides {
    /// Sets the fields given in `self` on `m`.
    pub fn apply_to(self, m: &mut Model) {
        if let Some(v) = self.layers {
            m.layers = v;
        }
        m.kv_dim = self.kv_dim.unwrap_or(m.kv_dim);
        m.dtype = self.dtype.unwrap_or(m.dtype);
        m.window = self.window.unwrap_or(m.window);
        m.gpu_chunks = self.gpu_chunks.unwrap_or(m.gpu_chunks);
        m.indexer_bytes_per_token = self.indexer_bytes_per_token.unwrap_or(m.indexer_bytes_per_token);
        m.scorer_weight_bytes = self.scorer_weight_bytes.unwrap_or(m.scorer_weight_bytes);
    }
}

/// Parses a token count: `1M` (1,048,576), `256K` (262,144), `8k`, `1G`, or a
/// plain integer, optionally grouped in thousands by `_` or `,`
/// (`1,048,576`; `1,5K` is refused, not read as 15K). K = 1024, M = 1024 x
/// 1024, G = 1024^3. `what` names the flag in errors.
pub fn parse_tokens(what: &str, s: &str) -> Result<u64, PlanError> {
    let t = s.trim();
    let (digits, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1u64 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1u64 << 30),
        _ => (t, 1),
    };
    let usage = "expected a token count such as 8K, 256K, 1M or 1048576 (K = 1024)";
    // Separators only between thousands: a first group of 1-3 digits, then
    // groups of exactly 3, all split by the same separator.
    let groups: Vec<&str> = digits.split(['_', ',']).collect();
    let grouped = groups.len() == 1
        || (digits.contains('_') != digits.contains(',')
            && (1..=3).contains(&groups[0].len())
            && groups[1..].iter().all(|g| g.len() == 3));
    if !grouped {
        return Err(PlanError::new(what, s, format!("{usage}; `_` or `,` only between groups of three digits (1,048,576)")));
    }
    let clean: String = groups.concat();
    if clean.is_empty() || !clean.bytes().all(|b| b.is_ascii_digit()) {
        return Err(PlanError::new(what, s, usage));
    }
    let n: u64 = clean.parse().map_err(|_| PlanError::new(what, s, "too large"))?;
    let n = n.checked_mul(mult).ok_or_else(|| PlanError::new(what, s, "too large"))?;
    if n == 0 {
        return Err(PlanError::new(what, s, "must be at least 1 token"));
    }
    Ok(n)
}

/// Parses `--layers 20x4,21x128`: comma-separated `COUNTxRATIO` classes.
pub fn parse_layers(s: &str) -> Result<Vec<LayerClass>, PlanError> {
    let bad = |reason: &str| PlanError::new("--layers", s, reason);
    if s.trim().is_empty() {
        return Err(bad("no layer class given (expected e.g. 20x4,21x128)"));
    }
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim) {
        if part.is_empty() {
            // "20x4,", ",21x128", "20x4,,21x128": a stray comma, not a class
            // silently dropped.
            return Err(bad("an empty layer class (a stray comma?): expected COUNTxRATIO between commas, e.g. 20x4,21x128"));
        }
        let (count, ratio) = part
            .split_once(['x', 'X', '*'])
            .ok_or_else(|| bad(&format!("{part:?} is not COUNTxRATIO (expected e.g. 20x4,21x128)")))?;
        let num = |v: &str, name: &str| {
            v.trim().parse::<u32>().map_err(|e| match e.kind() {
                std::num::IntErrorKind::PosOverflow => bad(&format!("{name} {v:?} in {part:?} is too large (at most {})", u32::MAX)),
                _ => bad(&format!("{name} {v:?} in {part:?} is not a whole number")),
            })
        };
        let class = LayerClass { count: num(count, "count")?, ratio: num(ratio, "ratio")? };
        if class.count == 0 {
            return Err(bad(&format!("count is 0 in {part:?}: a class needs at least one layer")));
        }
        if class.ratio == 0 {
            return Err(bad(&format!("ratio is 0 in {part:?}: a ratio must be >= 1")));
        }
        out.push(class);
    }
    Ok(out)
}

/// The plan of one layer class; byte figures are per layer ("each").
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassPlan {
    pub ratio: u32,
    pub count: u32,
    /// `ceil(context / ratio)`.
    pub compressed_cap: u64,
    pub chunk_bytes: u64,
    /// Swap is on iff `compressed_cap > gpu_chunks`.
    pub swap: bool,
    /// Host tier of one layer: `compressed_cap x chunk_bytes`.
    pub pinned_bytes_each: u64,
    /// GPU KV of one layer fully resident: `(window + compressed_cap) x chunk_bytes`.
    pub gpu_bytes_no_swap_each: u64,
    /// GPU KV of one layer with swap: `(window + min(gpu_chunks, compressed_cap)) x chunk_bytes`.
    pub gpu_bytes_swap_each: u64,
}

/// DESIGN.md's accounting: only the layers of the smallest ratio, and the
/// scorer's own GPU memory subtracted from the saving.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReferenceAccounting {
    pub ratio: u32,
    pub layers: u32,
    pub gpu_bytes_no_swap: u64,
    pub gpu_bytes_swap: u64,
    /// `context x indexer_bytes_per_token`.
    pub indexer_key_bytes: u64,
    pub scorer_weight_bytes: u64,
    /// `(no_swap - swap) - indexer keys - scorer weights`; negative when swap
    /// does not pay for the scorer.
    pub net_saving_bytes: i64,
}

/// Everything `kvswap plan` prints.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub context: u64,
    pub model: Model,
    pub classes: Vec<ClassPlan>,
    /// Sum over all layers of `compressed_cap x chunk_bytes`.
    pub pinned_bytes_total: u64,
    /// `max(256, next power of two >= pinned MiB)`.
    pub suggested_pinned_mib: u64,
    pub gpu_bytes_no_swap_total: u64,
    pub gpu_bytes_swap_total: u64,
    pub reference: ReferenceAccounting,
    /// What `kvswap_create` would refuse in this setup (its limits and the
    /// top-k guard at the default KVSWAP_INDEX_TOPK), one sentence each.
    pub warnings: Vec<String>,
}

impl Plan {
    pub fn pinned_mib(&self) -> f64 {
        self.pinned_bytes_total as f64 / MIB as f64
    }
    pub fn gpu_saving_bytes(&self) -> u64 {
        self.gpu_bytes_no_swap_total - self.gpu_bytes_swap_total
    }
    pub fn swap_layers(&self) -> u32 {
        self.classes.iter().filter(|c| c.swap).map(|c| c.count).sum()
    }
}

/// Plans one layer class.
pub fn plan_class(model: &Model, class: LayerClass, context: u64) -> ClassPlan {
    let chunk = model.chunk_bytes();
    let cap = context.div_ceil(class.ratio as u64);
    let window = model.window as u64;
    ClassPlan {
        ratio: class.ratio,
        count: class.count,
        compressed_cap: cap,
        chunk_bytes: chunk,
        swap: cap > model.gpu_chunks as u64,
        pinned_bytes_each: cap * chunk,
        gpu_bytes_no_swap_each: (window + cap) * chunk,
        gpu_bytes_swap_each: (window + cap.min(model.gpu_chunks as u64)) * chunk,
    }
}

/// `max(256, smallest power of two >= pinned_bytes in MiB)`.
pub fn suggested_pinned_mib(pinned_bytes: u64) -> u64 {
    pinned_bytes.div_ceil(MIB).next_power_of_two().max(MIN_SUGGESTED_PINNED_MIB)
}

/// Computes the plan of `model` at `context` tokens.
pub fn plan(model: &Model, context: u64) -> Result<Plan, PlanError> {
    model.validate()?;
    if context == 0 {
        return Err(PlanError::new("--context", context, "must be at least 1 token"));
    }
    check_fits_u64(model, context)?;
    let classes: Vec<ClassPlan> = model.layers.iter().map(|&c| plan_class(model, c, context)).collect();
    let total = |f: fn(&ClassPlan) -> u64| classes.iter().map(|c| f(c) * c.count as u64).sum::<u64>();
    let pinned = total(|c| c.pinned_bytes_each);
    let reference = reference_accounting(model, &classes, context);
    let warnings = create_limits(model, &classes);
    Ok(Plan {
        warnings,
        context,
        model: model.clone(),
        pinned_bytes_total: pinned,
        suggested_pinned_mib: suggested_pinned_mib(pinned),
        gpu_bytes_no_swap_total: total(|c| c.gpu_bytes_no_swap_each),
        gpu_bytes_swap_total: total(|c| c.gpu_bytes_swap_each),
        reference,
        classes,
    })
}

/// The limits `kvswap_create` applies (README, the header) that this setup
/// breaks: the plan still prints its figures, and says so.
fn create_limits(model: &Model, classes: &[ClassPlan]) -> Vec<String> {
    use crate::layer::{CHUNK_BYTES_MAX, ID_COUNT_MAX, PHYS_ID_BOUND};
    let mut w = Vec::new();
    if model.chunk_bytes() > CHUNK_BYTES_MAX {
        w.push(format!("chunk_bytes {} is above kvswap_create's limit of 1 GiB", thousands(model.chunk_bytes())));
    }
    if model.window as u64 > ID_COUNT_MAX {
        w.push(format!("window {} is above the limit {} (KVSWAP_WINDOW)", thousands(model.window as u64), thousands(ID_COUNT_MAX)));
    }
    if model.gpu_chunks as u64 > ID_COUNT_MAX {
        w.push(format!(
            "gpu_chunks {} is above the limit {} (KVSWAP_GPU_CHUNKS)",
            thousands(model.gpu_chunks as u64),
            thousands(ID_COUNT_MAX)
        ));
    }
    for c in classes {
        if c.compressed_cap >= ID_COUNT_MAX {
            w.push(format!(
                "layers at ratio {}: compressed_cap {} is at or above kvswap_create's limit {} (ids are int32)",
                c.ratio,
                thousands(c.compressed_cap),
                thousands(ID_COUNT_MAX)
            ));
        } else if model.window as u64 + if c.swap { model.gpu_chunks as u64 } else { c.compressed_cap } >= PHYS_ID_BOUND {
            w.push(format!("layers at ratio {}: window + slots reach 2^30 (physical ids are int32)", c.ratio));
        }
    }
    let topk = crate::config::Config::default().index_topk;
    if model.gpu_chunks < topk {
        w.push(format!(
            "gpu_chunks {} is below the default KVSWAP_INDEX_TOPK={topk}: kvswap_create refuses it (TOPK_GUARD) \
             unless index_topk <= gpu_chunks",
            model.gpu_chunks
        ));
    }
    w
}

/// Refuses inputs whose byte counts would overflow 64 bits (the largest
/// figure is every layer fully resident: `sum(count) x (window + context) x chunk_bytes`).
fn check_fits_u64(model: &Model, context: u64) -> Result<(), PlanError> {
    let layers: u128 = model.layers.iter().map(|c| c.count as u128).sum();
    let rows = context as u128 + model.window as u128;
    if layers * rows * model.chunk_bytes() as u128 > u64::MAX as u128 {
        return Err(PlanError::new("--context", context, "too large: the plan's byte counts overflow 64 bits"));
    }
    // The DESIGN line's figures: indexer keys of every token, scorer weights.
    if context as u128 * model.indexer_bytes_per_token as u128 > i64::MAX as u128 {
        return Err(PlanError::new(
            "--indexer-bytes-per-token",
            model.indexer_bytes_per_token,
            format!("too large: with --context {context} the indexer keys overflow 63 bits"),
        ));
    }
    if model.scorer_weight_bytes > i64::MAX as u64 {
        return Err(PlanError::new("--scorer-weight-bytes", model.scorer_weight_bytes, "must be below 2^63"));
    }
    Ok(())
}

/// DESIGN's line: the smallest-ratio layers only (all classes of that ratio).
fn reference_accounting(model: &Model, classes: &[ClassPlan], context: u64) -> ReferenceAccounting {
    let ratio = classes.iter().map(|c| c.ratio).min().unwrap_or(1);
    let of_ratio = || classes.iter().filter(move |c| c.ratio == ratio);
    let no_swap: u64 = of_ratio().map(|c| c.gpu_bytes_no_swap_each * c.count as u64).sum();
    let swap: u64 = of_ratio().map(|c| c.gpu_bytes_swap_each * c.count as u64).sum();
    let indexer = context.saturating_mul(model.indexer_bytes_per_token);
    let net = (no_swap - swap) as i128 - indexer as i128 - model.scorer_weight_bytes as i128;
    ReferenceAccounting {
        ratio,
        layers: of_ratio().map(|c| c.count).sum(),
        gpu_bytes_no_swap: no_swap,
        gpu_bytes_swap: swap,
        indexer_key_bytes: indexer,
        scorer_weight_bytes: model.scorer_weight_bytes,
        net_saving_bytes: net.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
    }
}

// ---------------------------------------------------------------- output

/// `1234567` -> `"1,234,567"`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// A float with `decimals` decimals and thousands separators: `11089.2`.
pub fn fixed(x: f64, decimals: usize) -> String {
    let s = format!("{:.*}", decimals, x.abs());
    let (int, frac) = s.split_once('.').map(|(i, f)| (i, Some(f))).unwrap_or((&s, None));
    let int = thousands(int.parse().unwrap_or(0));
    let sign = if x < 0.0 && s.chars().any(|c| c != '0' && c != '.') { "-" } else { "" };
    match frac {
        Some(f) => format!("{sign}{int}.{f}"),
        None => format!("{sign}{int}"),
    }
}

/// Decimal megabytes with 2 decimals: `536.87`.
pub fn mb(bytes: u64) -> String {
    fixed(bytes as f64 / MB, 2)
}

/// A token count as written on the command line (`1M`, `256K`) when exact.
pub fn tokens_short(n: u64) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        thousands(n)
    }
}

/// The human-readable plan that `kvswap plan` prints.
pub fn render(p: &Plan) -> String {
    let m = &p.model;
    let mut out = format!(
        "kvswap plan: context {} tokens ({}), kv_dim {} x {} = {} B per chunk, window {}, gpu_chunks {}\n\
         (MB and GB are decimal, 1e6 and 1e9 bytes; MiB is 2^20 bytes)\n\n",
        thousands(p.context),
        tokens_short(p.context),
        m.kv_dim,
        m.dtype,
        thousands(m.chunk_bytes()),
        m.window,
        m.gpu_chunks
    );
    out += &render_table(p);
    out += "\n";
    out += &render_totals(p);
    out += "\n";
    out += &render_reference(p);
    for w in &p.warnings {
        out += &format!("warning: {w}\n");
    }
    out
}

fn render_table(p: &Plan) -> String {
    let header = [
        "ratio",
        "layers",
        "compressed_cap",
        "chunk B",
        "swap",
        "pinned MB each",
        "GPU MB each, no swap",
        "GPU MB each, swap",
    ];
    let rows: Vec<[String; 8]> = p
        .classes
        .iter()
        .map(|c| {
            [
                c.ratio.to_string(),
                c.count.to_string(),
                thousands(c.compressed_cap),
                thousands(c.chunk_bytes),
                if c.swap { "on" } else { "off" }.to_string(),
                mb(c.pinned_bytes_each),
                mb(c.gpu_bytes_no_swap_each),
                mb(c.gpu_bytes_swap_each),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|i| rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0))
        .collect();
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
        format!("  {}\n", padded.join("  "))
    };
    let mut out = line(&header.map(String::from));
    for r in &rows {
        out += &line(r);
    }
    out
}

fn render_totals(p: &Plan) -> String {
    let swap_note = if p.swap_layers() == 0 {
        " (no layer has compressed_cap > gpu_chunks: swap stays off)".to_string()
    } else {
        format!(" ({} of {} layers swap)", p.swap_layers(), p.classes.iter().map(|c| c.count).sum::<u32>())
    };
    format!(
        "pinned host tier, all layers: {} MB = {} GB ({} MiB)\n\
         suggested KVSWAP_PINNED_MIB={}\n\
         GPU KV, all layers: {} MB without swap, {} MB with swap{}; saving {} MB\n",
        mb(p.pinned_bytes_total),
        fixed(p.pinned_bytes_total as f64 / GB, 2),
        fixed(p.pinned_mib(), 1),
        p.suggested_pinned_mib,
        mb(p.gpu_bytes_no_swap_total),
        mb(p.gpu_bytes_swap_total),
        swap_note,
        mb(p.gpu_saving_bytes()),
    )
}

/// One decimal in GB from 0.1 GB up (the precision of DESIGN's figures:
/// "10.7 GB", "0.5 GB"), else one decimal in MB ("26.2 MB").
pub fn human(bytes: f64) -> String {
    if bytes.abs() >= 0.1 * GB {
        format!("{} GB", fixed(bytes / GB, 1))
    } else {
        format!("{} MB", fixed(bytes / MB, 1))
    }
}

fn render_reference(p: &Plan) -> String {
    let r = &p.reference;
    let mb2 = |b: f64| fixed(b / MB, 2);
    let verdict = if r.net_saving_bytes < 0 { " (swap does not pay for the scorer at this context)" } else { "" };
    format!(
        "counting the ratio-{} layers only as the reference table does ({} layers):\n\
         \x20 GPU KV {} without swap vs {} with swap ({} slots per layer)\n\
         \x20 indexer keys {} ({} tokens x {} B), scorer weights {}\n\
         \x20 net GPU saving {}{}\n\
         \x20   = ({} MB - {} MB) - {} MB indexer keys - {} MB scorer weights = {} MB\n",
        r.ratio,
        r.layers,
        human(r.gpu_bytes_no_swap as f64),
        human(r.gpu_bytes_swap as f64),
        p.model.gpu_chunks,
        human(r.indexer_key_bytes as f64),
        thousands(p.context),
        thousands(p.model.indexer_bytes_per_token),
        human(r.scorer_weight_bytes as f64),
        human(r.net_saving_bytes as f64),
        verdict,
        mb2(r.gpu_bytes_no_swap as f64),
        mb2(r.gpu_bytes_swap as f64),
        mb2(r.indexer_key_bytes as f64),
        mb2(r.scorer_weight_bytes as f64),
        mb2(r.net_saving_bytes as f64),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: u64 = 1 << 10;
    const M: u64 = 1 << 20;

    /// Rounds `x` to `sig` significant digits, the way DESIGN.md writes figures.
    fn sig(x: f64, sig: i32) -> f64 {
        if x == 0.0 {
            return 0.0;
        }
        let scale = 10f64.powi(sig - 1 - x.abs().log10().floor() as i32);
        (x * scale).round() / scale
    }

    fn reference(context: u64) -> Plan {
        plan(&Model::default(), context).unwrap()
    }

    /// One row of DESIGN.md's reference table, with the significant digits
    /// DESIGN writes each figure with ("4.2 MB", "134 MB", "~2.77 GB").
    struct DesignRow {
        context: u64,
        caps: (u64, u64),
        mb_each: (f64, f64),
        mb_each_digits: (i32, i32),
        total_mb: f64,
        total_digits: i32,
        suggested_mib: u64,
    }

    const DESIGN_ROWS: [DesignRow; 3] = [
        DesignRow {
            context: 8 * K,
            caps: (2_048, 64),
            mb_each: (4.2, 0.13),
            mb_each_digits: (2, 2),
            total_mb: 87.0,
            total_digits: 2,
            suggested_mib: 256,
        },
        DesignRow {
            context: 256 * K,
            caps: (65_536, 2_048),
            mb_each: (134.0, 4.2),
            mb_each_digits: (3, 2),
            total_mb: 2_770.0,
            total_digits: 3,
            suggested_mib: 4_096,
        },
        DesignRow {
            context: M,
            caps: (262_144, 8_192),
            mb_each: (537.0, 17.0),
            mb_each_digits: (3, 2),
            total_mb: 11_000.0,
            total_digits: 2,
            suggested_mib: 16_384,
        },
    ];

    #[test]
    fn reproduces_design_reference_table() {
        for row in DESIGN_ROWS {
            let ctx = row.context;
            let p = reference(ctx);
            let (a, b) = (&p.classes[0], &p.classes[1]);
            assert_eq!((a.ratio, a.count, b.ratio, b.count), (4, 20, 128, 21));
            assert_eq!((a.compressed_cap, b.compressed_cap), row.caps, "caps at {ctx}");
            assert_eq!(a.chunk_bytes, 2048);
            assert_eq!(
                sig(a.pinned_bytes_each as f64 / MB, row.mb_each_digits.0),
                row.mb_each.0,
                "ratio-4 MB each at {ctx}"
            );
            assert_eq!(
                sig(b.pinned_bytes_each as f64 / MB, row.mb_each_digits.1),
                row.mb_each.1,
                "ratio-128 MB each at {ctx}"
            );
            let total = p.pinned_bytes_total as f64 / MB;
            assert_eq!(sig(total, row.total_digits), row.total_mb, "pinned total at {ctx}: {total} MB");
            assert_eq!(p.suggested_pinned_mib, row.suggested_mib, "suggested MiB at {ctx}");
        }
    }

    #[test]
    fn warns_where_kvswap_create_would_refuse() {
        assert!(reference(M).warnings.is_empty(), "{:?}", reference(M).warnings);
        let big = reference(1 << 34); // 16G tokens: ratio-4 caps of 2^32
        assert_eq!(big.warnings.len(), 1, "{:?}", big.warnings);
        assert!(big.warnings[0].contains("ratio 4") && big.warnings[0].contains("1,073,741,823"), "{:?}", big.warnings);
        let small = plan(&Model { gpu_chunks: 256, ..Model::default() }, M).unwrap();
        assert!(small.warnings.iter().any(|w| w.contains("TOPK_GUARD")), "{:?}", small.warnings);
        assert!(render(&small).contains("\nwarning: gpu_chunks 256"));
        // kvswap_create refuses gpu_chunks above 2^30 - 1 (Config::validate).
        let huge = plan(&Model { layers: vec![LayerClass { count: 1, ratio: 1 }], gpu_chunks: 2_000_000_000, window: 0, ..Model::default() }, M).unwrap();
        assert!(huge.warnings.iter().any(|w| w.contains("gpu_chunks 2,000,000,000 is above the limit")), "{:?}", huge.warnings);
        let cfg = crate::config::Config { gpu_chunks: 2_000_000_000, index_topk: 1, ..Default::default() };
        assert!(cfg.validate().is_err(), "the plan's limit is kvswap_create's");
    }

    #[test]
    fn reproduces_design_1m_gpu_accounting() {
        let p = reference(M);
        let r = &p.reference;
        assert_eq!((r.ratio, r.layers), (4, 20));
        assert_eq!(sig(r.gpu_bytes_no_swap as f64 / GB, 3), 10.7);
        // 20 x (128 window + 512 slots) rows x 2 KB
        assert_eq!(r.gpu_bytes_swap, 20 * 640 * 2048);
        assert_eq!(sig(r.gpu_bytes_swap as f64 / MB, 2), 26.0);
        assert_eq!(sig(r.indexer_key_bytes as f64 / GB, 2), 5.6);
        assert_eq!(r.scorer_weight_bytes, 500_000_000);
        assert_eq!(sig(r.net_saving_bytes as f64 / GB, 2), 4.6);
        assert_eq!(p.reference.gpu_bytes_no_swap, 20 * (128 + 262_144) * 2048);
    }

    #[test]
    fn every_layer_counts_in_pinned_and_swap_follows_cap() {
        // At 8K the ratio-128 layers have cap 64 <= 512: swap off, still pinned.
        let p = reference(8 * K);
        assert!(p.classes[0].swap && !p.classes[1].swap);
        assert_eq!(p.pinned_bytes_total, (20 * 2048 + 21 * 64) * 2048);
        assert_eq!(p.classes[1].gpu_bytes_swap_each, p.classes[1].gpu_bytes_no_swap_each);
        assert_eq!(p.swap_layers(), 20);
        // cap == gpu_chunks exactly: swap off.
        let m = Model { layers: vec![LayerClass { count: 1, ratio: 1 }], gpu_chunks: 100, ..Model::default() };
        assert!(!plan(&m, 100).unwrap().classes[0].swap);
        assert!(plan(&m, 101).unwrap().classes[0].swap);
    }

    #[test]
    fn cap_rounds_up_and_dtype_sets_chunk_bytes() {
        let m = Model { dtype: Dtype::Bf16, layers: vec![LayerClass { count: 2, ratio: 4 }], ..Model::default() };
        let p = plan(&m, 1001).unwrap();
        assert_eq!(p.classes[0].compressed_cap, 251);
        assert_eq!(p.classes[0].chunk_bytes, 1024);
        assert_eq!(p.pinned_bytes_total, 2 * 251 * 1024);
        assert_eq!(Dtype::parse("FP8").map(Dtype::bytes), Some(1));
        assert_eq!(Dtype::parse("f16").map(Dtype::bytes), Some(2));
        assert_eq!(Dtype::parse("int4"), None);
    }

    #[test]
    fn suggested_pinned_mib_rounds_to_power_of_two() {
        assert_eq!(suggested_pinned_mib(1), 256);
        assert_eq!(suggested_pinned_mib(256 * MIB), 256);
        assert_eq!(suggested_pinned_mib(256 * MIB + 1), 512);
        assert_eq!(suggested_pinned_mib(4096 * MIB), 4096);
    }

    #[test]
    fn parses_token_counts() {
        assert_eq!(parse_tokens("--context", "1M").unwrap(), 1_048_576);
        assert_eq!(parse_tokens("--context", "256k").unwrap(), 262_144);
        assert_eq!(parse_tokens("--context", "8K").unwrap(), 8_192);
        assert_eq!(parse_tokens("--context", "1_000").unwrap(), 1_000);
        assert_eq!(parse_tokens("--context", "1,048,576").unwrap(), 1_048_576);
        assert_eq!(parse_tokens("--context", "1G").unwrap(), 1 << 30);
        assert!(parse_tokens("--context", "99999999999999G").is_err());
        // Separators only between thousands: a decimal comma is not x10.
        for bad in ["1,5K", "1,,,K", "1__0", "1,000_000", "1234,567", ",123", "123,"] {
            let e = parse_tokens("--context", bad).unwrap_err();
            assert!(e.reason.contains("groups of three digits"), "{bad}: {e}");
        }
        let e = parse_tokens("--context", "99999999999999999999999").unwrap_err();
        assert_eq!(e.reason, "too large", "{e}");
        let e = plan(&Model::default(), u64::MAX / 2).unwrap_err();
        assert!(e.reason.contains("overflow"), "{e}");
        for bad in ["0", "0K", "", "K", "1.5M", "-3", "ten"] {
            let e = parse_tokens("--context", bad).unwrap_err();
            assert_eq!((e.what.as_str(), e.value.as_str()), ("--context", bad));
            assert!(e.to_string().contains("--context"), "{e}");
        }
    }

    #[test]
    fn parses_layer_classes() {
        let l = parse_layers("20x4, 21x128").unwrap();
        assert_eq!(l, vec![LayerClass { count: 20, ratio: 4 }, LayerClass { count: 21, ratio: 128 }]);
        for bad in ["", " ", "20", "20x", "x4", "20x0", "0x4", "20x4,abc", "20y4", "20x4,", ",20x4", "20x4,,21x128", "20x4, ,21x128"] {
            let e = parse_layers(bad).unwrap_err();
            assert_eq!(e.what, "--layers", "{bad}");
            assert_eq!(e.value, bad);
        }
        assert!(parse_layers("20x0").unwrap_err().reason.contains("ratio"));
        assert!(parse_layers("20x4,").unwrap_err().reason.contains("stray comma"));
        assert!(parse_layers("4294967296x1").unwrap_err().reason.contains("too large"));
        assert!(parse_layers("2.5x1").unwrap_err().reason.contains("not a whole number"));
        assert!(parse_layers("").unwrap_err().reason.contains("no layer class"));
    }

    #[test]
    fn model_file_overrides_defaults_and_names_bad_fields() {
        let m = Model::from_toml_str("kv_dim = 256\ndtype = \"bf16\"\n[[layers]]\ncount = 3\nratio = 8\n").unwrap();
        assert_eq!(m.kv_dim, 256);
        assert_eq!(m.dtype, Dtype::Bf16);
        assert_eq!(m.layers, vec![LayerClass { count: 3, ratio: 8 }]);
        assert_eq!(m.window, 128, "unspecified fields keep the reference values");
        let e = Model::from_toml_str("[[layers]]\ncount = 3\nratio = 0\n").unwrap_err();
        assert_eq!(e.what, "layers[0].ratio", "{e}");
        let e = Model::from_toml_str("dtype = \"int3\"\n").unwrap_err();
        assert!(e.reason.contains("int3"), "{e}");
        let e = Model::from_toml_str("kv_dimm = 3\n").unwrap_err();
        assert!(e.reason.contains("kv_dimm"), "{e}");
    }

    #[test]
    fn layer_counts_past_the_limit_are_refused() {
        let m = Model { layers: vec![LayerClass { count: 1 << 31, ratio: 4 }, LayerClass { count: 1 << 31, ratio: 8 }], ..Model::default() };
        let e = m.validate().unwrap_err();
        assert_eq!(e.what, "--layers", "{e}");
    }

    #[test]
    fn reference_model_file_is_the_default() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("integrations/models/reference.toml");
        assert_eq!(Model::from_toml_file(&path).unwrap(), Model::default());
        // Every field written out, not left to the defaults: parsed as a
        // whole Model (no field optional), it is still the default.
        let whole: Model = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(whole, Model::default());
        let e = Model::from_toml_file(Path::new("/nonexistent/model.toml")).unwrap_err();
        assert_eq!((e.what.as_str(), e.value.as_str()), ("--model", "/nonexistent/model.toml"));
        let m = Model { kv_dim: 0, ..Model::default() };
        assert_eq!(m.validate().unwrap_err().what, "--kv-dim");
    }

    #[test]
    fn formats_numbers() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(1_048_576), "1,048,576");
        assert_eq!(fixed(11_089.234, 1), "11,089.2");
        assert_eq!(fixed(-4.58, 1), "-4.6");
        assert_eq!(fixed(-0.01, 1), "0.0");
        assert_eq!(tokens_short(1 << 20), "1M");
        assert_eq!(tokens_short(65_536), "64K");
        assert_eq!(tokens_short(1000), "1,000");
        assert_eq!(human(10.742e9), "10.7 GB");
        assert_eq!(human(0.5e9), "0.5 GB");
        assert_eq!(human(26.2144e6), "26.2 MB");
        assert_eq!(human(-4.8e8), "-0.5 GB");
    }

    #[test]
    fn rendered_plan_shows_design_figures() {
        let text = render(&reference(M));
        for needle in [
            "262,144",
            "8,192",
            "536.87",
            "16.78",
            "KVSWAP_PINNED_MIB=16384",
            "10.7 GB",
            "26.2 MB",
            "5.6 GB",
            "0.5 GB",
            "net GPU saving 4.6 GB",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
    }
}

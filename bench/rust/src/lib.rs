//! What the benchmark programs of superoffload share: one command-line parser ([`Cli`],
//! [`main_with`]), the number and core-list formats of their flags, percentiles of samples,
//! JSON numbers, and the CPU affinity helpers.
//!
//! Every program parses its flags the same way:
//!
//! ```no_run
//! use superoffload_bench::{Cli, main_with};
//!
//! struct Args {
//!     n: usize,
//!     quiet: bool,
//! }
//!
//! fn parse(cli: &mut Cli) -> Result<Args, String> {
//!     let mut a = Args { n: 10, quiet: false };
//!     while let Some(flag) = cli.next_flag() {
//!         match flag.as_str() {
//!             "--n" => a.n = cli.count()?,
//!             "--quiet" => a.quiet = cli.switch()?,
//!             _ => return Err(cli.unknown()),
//!         }
//!     }
//!     Ok(a)
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     main_with("example", "USAGE: example [--n N] [--quiet]", parse, |a| {
//!         println!("{} {}", a.n, a.quiet);
//!         Ok(())
//!     })
//! }
//! ```
//!
//! Flags take their value as the next argument or after `=` (`--n 1e6`, `--n=1e6`); `-h` and
//! `--help` print the program's usage text and exit 0, whatever else was given.

use std::process::ExitCode;
use std::time::Duration;

/// The exit status of a usage error (unknown flag, bad or missing value).
pub const EXIT_USAGE: u8 = 2;
/// The exit status of a benchmark that failed while running.
pub const EXIT_FAILURE: u8 = 1;

/// A command line being parsed: hands out the flags one by one and parses the value of the
/// current one.
#[derive(Debug)]
pub struct Cli {
    args: std::vec::IntoIter<String>,
    /// The current flag (without an inline value).
    flag: String,
    /// The argument as given (for messages).
    raw: String,
    /// The value given inline (`--flag=value`).
    inline: Option<String>,
    help: bool,
}

impl Cli {
    /// A parser over `args` (without the program name).
    pub fn new<I: IntoIterator<Item = String>>(args: I) -> Self {
        let args: Vec<String> = args.into_iter().collect();
        Cli { args: args.into_iter(), flag: String::new(), raw: String::new(), inline: None, help: false }
    }

    /// A parser over this process's arguments.
    pub fn from_env() -> Self {
        Self::new(std::env::args().skip(1))
    }

    /// The next flag (`--name`, with any `=value` split off), or `None` at the end of the
    /// arguments or at `-h` / `--help` (then [`Cli::help_requested`] is true).
    pub fn next_flag(&mut self) -> Option<String> {
        if self.help {
            return None;
        }
        let arg = self.args.next()?;
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        if flag == "-h" || flag == "--help" {
            self.help = true;
            return None;
        }
        self.raw = arg;
        self.flag = flag.clone();
        self.inline = inline;
        Some(flag)
    }

    /// Whether `-h` or `--help` was given.
    pub fn help_requested(&self) -> bool {
        self.help
    }

    /// The current flag's value: given inline or as the next argument.
    pub fn value(&mut self) -> Result<String, String> {
        match self.inline.take() {
            Some(v) => Ok(v),
            None => self.args.next().ok_or_else(|| format!("{} needs a value", self.flag)),
        }
    }

    /// A flag that takes no value: `true`, or an error for `--flag=value`.
    pub fn switch(&mut self) -> Result<bool, String> {
        match self.inline.take() {
            Some(v) => Err(format!("{} takes no value (got {v:?})", self.flag)),
            None => Ok(true),
        }
    }

    /// The value as a count ([`parse_count`]).
    pub fn count(&mut self) -> Result<usize, String> {
        let v = self.value()?;
        parse_count(&self.flag, &v)
    }

    /// The value as a core list ([`parse_cores`]).
    pub fn cores(&mut self) -> Result<Vec<usize>, String> {
        let v = self.value()?;
        parse_cores(&self.flag, &v)
    }

    /// The value as a duration in milliseconds (finite, >= 0, fractions allowed).
    pub fn millis(&mut self) -> Result<Duration, String> {
        let v = self.value()?;
        parse_millis(&self.flag, &v)
    }

    /// The value as one of `choices` (name, meaning).
    pub fn choice<T: Copy>(&mut self, choices: &[(&str, T)]) -> Result<T, String> {
        let v = self.value()?;
        choices.iter().find(|(name, _)| *name == v).map(|&(_, t)| t).ok_or_else(|| {
            let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
            format!("{}: {v:?} is not one of {}", self.flag, names.join(", "))
        })
    }

    /// The error for an argument the program does not know.
    pub fn unknown(&self) -> String {
        format!("unknown argument {:?}", self.raw)
    }
}

/// The `main` of a benchmark program: parses this process's arguments with `parse`, prints
/// `usage` for `-h` / `--help`, then runs `body`. Errors are printed as `<program>: error:
/// ...`; the exit status is 0, [`EXIT_USAGE`] for a usage error, [`EXIT_FAILURE`] when
/// `body` fails.
pub fn main_with<A>(
    program: &str,
    usage: &str,
    parse: impl FnOnce(&mut Cli) -> Result<A, String>,
    body: impl FnOnce(A) -> Result<(), String>,
) -> ExitCode {
    let mut cli = Cli::from_env();
    let parsed = parse(&mut cli);
    if cli.help_requested() {
        println!("{usage}");
        return ExitCode::SUCCESS;
    }
    let args = match parsed {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{program}: error: {e} (try --help)");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match body(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// A count: `100000000`, `1e8`, `1_000`, or with a `k` / `m` suffix (×1024, ×1024²).
pub fn parse_count(flag: &str, s: &str) -> Result<usize, String> {
    let cleaned = s.to_ascii_lowercase().replace('_', "");
    if !cleaned.is_empty() && cleaned.bytes().all(|b| b.is_ascii_digit()) {
        return cleaned.parse::<usize>().map_err(|e| format!("{flag}: {s:?}: {e}"));
    }
    let (digits, mult) = match (cleaned.strip_suffix('k'), cleaned.strip_suffix('m')) {
        (Some(d), _) => (d, 1024.0),
        (_, Some(d)) => (d, 1024.0 * 1024.0),
        _ => (cleaned.as_str(), 1.0),
    };
    let x = digits.parse::<f64>().map_err(|_| format!("{flag}: {s:?} is not a number"))? * mult;
    if !x.is_finite() || x < 0.0 || x.fract() != 0.0 || x > 1e15 {
        return Err(format!("{flag}: {s:?} is not a whole non-negative number"));
    }
    Ok(x as usize)
}

/// A core list: `0-3,8,10-11`.
pub fn parse_cores(flag: &str, s: &str) -> Result<Vec<usize>, String> {
    let mut cores = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || format!("{flag}: {part:?} is not a core or a range like 2-5");
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) =
                    (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
                if a > b {
                    return Err(bad());
                }
                cores.extend(a..=b);
            }
            None => cores.push(part.parse().map_err(|_| bad())?),
        }
    }
    if cores.is_empty() {
        return Err(format!("{flag}: the list is empty"));
    }
    Ok(cores)
}

/// A duration in milliseconds: finite, >= 0, fractions allowed (`0.5`).
pub fn parse_millis(flag: &str, s: &str) -> Result<Duration, String> {
    let x: f64 = s.parse().map_err(|_| format!("{flag}: {s:?} is not a number"))?;
    if !x.is_finite() || x < 0.0 {
        return Err(format!("{flag}: {s:?} must be finite and >= 0"));
    }
    Ok(Duration::from_secs_f64(x / 1e3))
}

/// `samples` in ascending order (NaN last).
pub fn sorted(mut samples: Vec<f64>) -> Vec<f64> {
    samples.sort_by(f64::total_cmp);
    samples
}

/// The `q` quantile (0 to 1) of samples in ascending order ([`sorted`]), interpolated linearly
/// between the two nearest samples; NaN when there are none.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// The median of `samples`, in any order ([`percentile`] 0.5).
pub fn median(samples: &[f64]) -> f64 {
    percentile(&sorted(samples.to_vec()), 0.5)
}

/// A JSON number, or null for inf/NaN.
pub fn json_num(x: f64) -> String {
    if x.is_finite() { format!("{x}") } else { "null".to_string() }
}

/// Writes a bench's JSON document for `--json PATH` (`-`: standard output).
pub fn write_json(path: &str, json: &str) -> Result<(), String> {
    if path == "-" {
        println!("{json}");
        Ok(())
    } else {
        std::fs::write(path, format!("{json}\n")).map_err(|e| format!("--json {path}: {e}"))
    }
}

/// Where a session benchmark's threads run: `--train-core` for the training thread and
/// `--pool-cores` for the pool, each by default from the process's affinity mask.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Cores {
    pub train: Option<usize>,
    pub pool: Option<Vec<usize>>,
}

impl Cores {
    /// Takes `flag` if it is `--train-core` or `--pool-cores`: whether it was one of them.
    pub fn take_flag(&mut self, cli: &mut Cli, flag: &str) -> Result<bool, String> {
        match flag {
            "--train-core" => self.train = Some(cli.count()?),
            "--pool-cores" => self.pool = Some(cli.cores()?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The training core and the pool's cores: as given, else the first allowed CPU and the
    /// other allowed CPUs. The pool needs at least one core, none of them the training core.
    pub fn resolve(&self) -> Result<(usize, Vec<usize>), String> {
        let cpus = allowed_cpus();
        let train = self.train.or_else(|| cpus.first().copied()).ok_or("no CPU in the affinity mask")?;
        let pool = match &self.pool {
            Some(c) => c.clone(),
            None => cpus.iter().copied().filter(|&c| c != train).collect(),
        };
        if pool.is_empty() {
            return Err(format!(
                "no core left for the session pool (the training thread has core {train}); pass --pool-cores"
            ));
        }
        if pool.contains(&train) {
            return Err(format!("the training core {train} is also a pool core"));
        }
        Ok((train, pool))
    }
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    superoffload::kernels::pool::allowed_cores().unwrap_or_default()
}

/// Pins the calling thread to `cores`.
pub fn pin_current_thread(cores: &[usize]) -> Result<(), String> {
    superoffload::kernels::pool::pin_current_thread_to(cores).map_err(|e| e.message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::new(args.iter().map(|s| s.to_string()))
    }

    #[derive(Debug, PartialEq)]
    struct A {
        n: usize,
        cores: Option<Vec<usize>>,
        ms: Duration,
        flag: bool,
        mode: u8,
        json: Option<String>,
    }

    fn parse(c: &mut Cli) -> Result<A, String> {
        let mut a = A { n: 7, cores: None, ms: Duration::ZERO, flag: false, mode: 0, json: None };
        while let Some(flag) = c.next_flag() {
            match flag.as_str() {
                "--n" => a.n = c.count()?,
                "--cores" => a.cores = Some(c.cores()?),
                "--ms" => a.ms = c.millis()?,
                "--flag" => a.flag = c.switch()?,
                "--mode" => a.mode = c.choice(&[("one", 1), ("two", 2)])?,
                "--json" => a.json = Some(c.value()?),
                _ => return Err(c.unknown()),
            }
        }
        Ok(a)
    }

    #[test]
    fn values_inline_or_next() {
        let mut c = cli(&["--n", "1e3", "--cores=0-2,5", "--ms", "0.5", "--flag", "--mode=two", "--json", "-"]);
        let a = parse(&mut c).unwrap();
        assert!(!c.help_requested());
        assert_eq!(
            a,
            A {
                n: 1000,
                cores: Some(vec![0, 1, 2, 5]),
                ms: Duration::from_micros(500),
                flag: true,
                mode: 2,
                json: Some("-".into())
            }
        );
    }

    #[test]
    fn defaults_without_arguments() {
        let a = parse(&mut cli(&[])).unwrap();
        assert_eq!(a.n, 7);
        assert!(!a.flag && a.cores.is_none() && a.json.is_none());
    }

    #[test]
    fn errors_name_the_flag() {
        let err = |args: &[&str]| parse(&mut cli(args)).unwrap_err();
        assert_eq!(err(&["--n"]), "--n needs a value");
        assert_eq!(err(&["--bogus", "1"]), "unknown argument \"--bogus\"");
        assert_eq!(err(&["--bogus=1"]), "unknown argument \"--bogus=1\"");
        assert_eq!(err(&["positional"]), "unknown argument \"positional\"");
        assert_eq!(err(&["--flag=yes"]), "--flag takes no value (got \"yes\")");
        assert_eq!(err(&["--mode", "three"]), "--mode: \"three\" is not one of one, two");
        assert!(err(&["--n", "1.5"]).starts_with("--n: "));
        assert!(err(&["--ms", "-1"]).starts_with("--ms: "));
        assert!(err(&["--cores", "3-1"]).starts_with("--cores: "));
    }

    #[test]
    fn help_stops_parsing() {
        for args in [&["--help"][..], &["-h"], &["--n", "3", "--help", "--bogus"], &["--help", "--n"]] {
            let mut c = cli(args);
            assert!(parse(&mut c).is_ok(), "{args:?}");
            assert!(c.help_requested(), "{args:?}");
        }
        // A value that happens to be "--help" is a value.
        let mut c = cli(&["--json", "--help"]);
        assert_eq!(parse(&mut c).unwrap().json.as_deref(), Some("--help"));
        assert!(!c.help_requested());
    }

    #[test]
    fn counts() {
        assert_eq!(parse_count("f", "100000000"), Ok(100_000_000));
        assert_eq!(parse_count("f", "1e8"), Ok(100_000_000));
        assert_eq!(parse_count("f", "1_000"), Ok(1000));
        assert_eq!(parse_count("f", "512k"), Ok(512 * 1024));
        assert_eq!(parse_count("f", "1m"), Ok(1024 * 1024));
        assert_eq!(parse_count("f", "0"), Ok(0));
        for bad in ["", "x", "-1", "1.5", "inf", "1e16", "k"] {
            assert!(parse_count("f", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn core_lists() {
        assert_eq!(parse_cores("c", "0-3,8,10-11"), Ok(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cores("c", " 2 , 4 "), Ok(vec![2, 4]));
        for bad in ["", ",", "a", "3-1", "1-", "-2"] {
            assert!(parse_cores("c", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn percentiles() {
        let s = sorted(vec![4.0, 1.0, 3.0, 2.0]);
        assert_eq!(s, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(percentile(&s, 0.0), 1.0);
        assert_eq!(percentile(&s, 0.5), 2.5);
        assert_eq!(percentile(&s, 0.9), 3.7);
        assert_eq!(percentile(&s, 1.0), 4.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert!(percentile(&[], 0.5).is_nan() && median(&[]).is_nan());
    }

    #[test]
    fn json_numbers() {
        assert_eq!(json_num(1.5), "1.5");
        assert_eq!(json_num(f64::NAN), "null");
        assert_eq!(json_num(f64::INFINITY), "null");
    }
}

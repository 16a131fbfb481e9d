//! Command-line helpers shared by the benchmark programs.
#![allow(dead_code)] // each program uses its own subset

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

/// A JSON number, or null for inf/NaN.
pub fn json_num(x: f64) -> String {
    if x.is_finite() { format!("{x}") } else { "null".to_string() }
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    superoffload::kernels::pool::allowed_cores().unwrap_or_default()
}

/// Pins the calling thread to `cores`.
pub fn pin_current_thread(cores: &[usize]) -> Result<(), String> {
    superoffload::kernels::pool::pin_current_thread_to(cores).map_err(|e| e.message)
}

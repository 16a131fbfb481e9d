//! The thread pool kernels run on: a dedicated rayon pool (never rayon's global one),
//! optionally one thread pinned per listed core, plus the instruction set it uses.

use std::sync::{Arc, LazyLock, Mutex};

use crate::error::{Error, Result, Status};

/// The instruction set a pool's kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust, one lane; runs everywhere.
    Portable,
    /// x86-64 AVX2 + FMA + F16C, 8 lanes.
    Avx2,
    /// x86-64 AVX-512F, 16 lanes.
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether the running CPU can execute this instruction set.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::simd::avx2::Avx2::detect().is_some(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => super::simd::avx512::Avx512::detect().is_some(),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// The widest instruction set the running CPU supports.
    pub fn best() -> Isa {
        [Isa::Avx512, Isa::Avx2].into_iter().find(|isa| isa.is_supported()).unwrap_or(Isa::Portable)
    }
}

/// How to build a [`Pool`]. Fields as [`so_pool_options`](crate::ffi::pool::so_pool_options)
/// documents them, in Rust types: `None` for a NULL `cores` and for `SO_ISA_AUTO`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolOptions {
    pub num_threads: usize,
    pub cores: Option<Vec<usize>>,
    pub isa: Option<Isa>,
}

/// A set of worker threads that kernels split their work across.
///
/// Thread-safety: `Pool` is `Send + Sync`; any number of threads may run kernels on one
/// pool at the same time (their chunks interleave; there is no pool-wide lock).
pub struct Pool {
    threads: Option<rayon::ThreadPool>,
    num_threads: usize,
    cores: Option<Vec<usize>>,
    isa: Isa,
    /// The pool's threads, spawned by us so that dropping the pool can join them.
    handles: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Pool {
    pub fn new(options: &PoolOptions) -> Result<Pool> {
        let isa = options.isa.unwrap_or_else(Isa::best);
        if !isa.is_supported() {
            return Err(Error::unsupported(format!(
                "instruction set {} is not supported by this CPU (best available: {})",
                isa.name(),
                Isa::best().name()
            )));
        }
        if let Some(cores) = &options.cores {
            validate_cores(cores)?;
            if options.num_threads != 0 && options.num_threads != cores.len() {
                return Err(Error::invalid(format!(
                    "num_threads is {} but {} cores are listed; pass 0 or the number of cores",
                    options.num_threads,
                    cores.len()
                )));
            }
        }
        let num_threads = match (&options.cores, options.num_threads) {
            (Some(cores), _) => cores.len(),
            (None, 0) => std::thread::available_parallelism().map_or(1, |n| n.get()),
            (None, n) => n,
        };
        if num_threads > MAX_THREADS {
            return Err(Error::invalid(format!("num_threads is {num_threads}; at most {MAX_THREADS} are supported")));
        }

        let handles = Arc::new(Mutex::new(Vec::with_capacity(num_threads)));
        let spawned = handles.clone();
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(num_threads)
            .spawn_handler(move |thread| {
                let name = format!("superoffload-{}", thread.index());
                let handle = std::thread::Builder::new().name(name).spawn(|| thread.run())?;
                spawned.lock().unwrap().push(handle);
                Ok(())
            })
            .build()
            .map_err(|e| Error::new(Status::OutOfResources, format!("cannot start pool threads: {e}")))?;
        let handles = std::mem::take(&mut *handles.lock().unwrap());

        let pool = Pool {
            threads: Some(threads),
            num_threads,
            cores: options.cores.clone(),
            isa,
            handles: Mutex::new(handles),
        };
        // Every thread runs this once: afterwards all are pinned.
        let cores = pool.cores.clone();
        let pinned = pool.rayon().broadcast(|ctx| match &cores {
            Some(cores) => pin_current_thread(cores[ctx.index()]),
            None => Ok(()),
        });
        pinned.into_iter().collect::<Result<Vec<()>>>()?;
        Ok(pool)
    }

    /// The process-wide pool used when a caller names none: one unpinned thread per CPU
    /// this process may run on, widest instruction set. Created on first use.
    pub fn default_pool() -> Result<Arc<Pool>> {
        static DEFAULT: LazyLock<Result<Arc<Pool>>> =
            LazyLock::new(|| Pool::new(&PoolOptions::default()).map(Arc::new));
        DEFAULT.clone()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn num_threads(&self) -> usize {
        self.num_threads
    }

    pub fn cores(&self) -> Option<&[usize]> {
        self.cores.as_deref()
    }

    fn rayon(&self) -> &rayon::ThreadPool {
        self.threads.as_ref().expect("pool threads exist until drop")
    }

    /// Runs every job on the pool's threads and returns when all have finished. Even a
    /// single job runs on a pool thread, so that every element is computed under the
    /// same floating-point environment whatever the caller's thread has set.
    pub(crate) fn run_all<F: FnOnce() + Send>(&self, jobs: Vec<F>) {
        self.rayon().scope(|scope| {
            for job in jobs {
                scope.spawn(move |_| {
                    #[cfg(feature = "fault-injection")]
                    chunk_pause();
                    job()
                });
            }
        });
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("isa", &self.isa)
            .field("threads", &self.num_threads)
            .field("cores", &self.cores)
            .finish()
    }
}

impl Drop for Pool {
    /// Stops the threads and joins them: when this returns, none is running.
    fn drop(&mut self) {
        drop(self.threads.take());
        for handle in self.handles.get_mut().unwrap().drain(..) {
            let _ = handle.join();
        }
    }
}

const MAX_THREADS: usize = 4096;

fn validate_cores(cores: &[usize]) -> Result<()> {
    if cores.is_empty() {
        return Err(Error::invalid("the core list is empty; pass no list to leave threads unpinned"));
    }
    let allowed = allowed_cores()?;
    for (i, &core) in cores.iter().enumerate() {
        if !allowed.contains(&core) {
            return Err(Error::invalid(format!(
                "core {core} is not in this process's CPU affinity mask (allowed: {})",
                format_core_list(&allowed)
            )));
        }
        if cores[..i].contains(&core) {
            return Err(Error::invalid(format!("core {core} is listed twice")));
        }
    }
    Ok(())
}

/// The CPUs this process may run on (its main thread's affinity mask).
#[cfg(target_os = "linux")]
pub fn allowed_cores() -> Result<Vec<usize>> {
    // SAFETY: `set` is a plain bitmask that sched_getaffinity fills; zeroed is valid.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // The process's mask (its main thread's), not the calling thread's: a training thread
    // that pinned itself must not shrink what a pool may use.
    // SAFETY: getpid has no preconditions; the size matches `set`.
    let rc = unsafe { libc::sched_getaffinity(libc::getpid(), std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(Error::new(
            Status::OutOfResources,
            format!("sched_getaffinity failed: {}", std::io::Error::last_os_error()),
        ));
    }
    // SAFETY: CPU_ISSET only reads the bitmask, for indices below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

#[cfg(target_os = "linux")]
fn pin_current_thread(core: usize) -> Result<()> {
    // SAFETY: as in `allowed_cores`; `core` was validated to be below CPU_SETSIZE.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(Error::new(
            Status::OutOfResources,
            format!("cannot pin a pool thread to core {core}: {}", std::io::Error::last_os_error()),
        ));
    }
    Ok(())
}

/// Lets the calling thread run on any of `cores`.
#[cfg(target_os = "linux")]
pub fn pin_current_thread_to(cores: &[usize]) -> Result<()> {
    // SAFETY: as in `pin_current_thread`; the cores were validated when the pool was made.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &core in cores {
            libc::CPU_SET(core, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(Error::new(
            Status::OutOfResources,
            format!("sched_setaffinity: {}", std::io::Error::last_os_error()),
        ));
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub fn pin_current_thread_to(_cores: &[usize]) -> Result<()> {
    Err(Error::unsupported("pinning threads to cores is only supported on Linux"))
}

#[cfg(not(target_os = "linux"))]
pub fn allowed_cores() -> Result<Vec<usize>> {
    Err(Error::unsupported("pinning pool threads to cores is only supported on Linux"))
}

#[cfg(not(target_os = "linux"))]
fn pin_current_thread(_core: usize) -> Result<()> {
    Err(Error::unsupported("pinning pool threads to cores is only supported on Linux"))
}

/// Formats a sorted core list `0-3,8,10-11` style.
pub fn format_core_list(cores: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cores.len() {
        let mut j = i;
        while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { cores[i].to_string() } else { format!("{}-{}", cores[i], cores[j]) });
        i = j + 1;
    }
    parts.join(",")
}

/// Called before every chunk of every pass, in tests that prove that results do not depend
/// on timing (builds with the `fault-injection` feature only).
#[cfg(feature = "fault-injection")]
static CHUNK_PAUSE: std::sync::RwLock<Option<fn()>> = std::sync::RwLock::new(None);

/// Sets (or, with `None`, clears) the function called before every chunk of every pass.
#[cfg(feature = "fault-injection")]
pub fn set_chunk_pause(pause: Option<fn()>) {
    *CHUNK_PAUSE.write().unwrap() = pause;
}

#[cfg(feature = "fault-injection")]
fn chunk_pause() {
    if let Some(pause) = *CHUNK_PAUSE.read().unwrap() {
        pause();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_list_formatting() {
        assert_eq!(format_core_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_core_list(&[5]), "5");
    }

    #[test]
    fn pinned_pool_reports_its_cores() {
        let allowed = allowed_cores().unwrap();
        let pool = Pool::new(&PoolOptions { cores: Some(vec![allowed[0]]), ..Default::default() }).unwrap();
        assert_eq!(pool.num_threads(), 1);
        assert_eq!(pool.cores(), Some(&[allowed[0]][..]));
    }

    #[test]
    fn bad_core_lists_are_refused() {
        let err = Pool::new(&PoolOptions { cores: Some(vec![100_000]), ..Default::default() }).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument);
        assert!(err.message.contains("affinity mask"), "{}", err.message);
        let allowed = allowed_cores().unwrap();
        let twice = vec![allowed[0], allowed[0]];
        let err = Pool::new(&PoolOptions { cores: Some(twice), ..Default::default() }).err().unwrap();
        assert!(err.message.contains("listed twice"), "{}", err.message);
        let err = Pool::new(&PoolOptions { cores: Some(vec![]), ..Default::default() }).err().unwrap();
        assert!(err.message.contains("empty"), "{}", err.message);
    }
}

/**
 * @file superoffload.hpp
 * @brief Header-only C++17 wrapper over the superoffload C ABI (`superoffload.h`): the
 *        umbrella header, which includes every part of the wrapper.
 *
 * The parts, under `superoffload/` (each can be included on its own):
 *
 * | header                      | what it holds                                                    |
 * |-----------------------------|------------------------------------------------------------------|
 * | superoffload/version.hpp    | the C header, the C++17 check, ABI and library versions          |
 * | superoffload/error.hpp      | Error, check(), last_error_message(), status_str()               |
 * | superoffload/types.hpp      | the C enumerations (DType, Isa, Mode, ...), bf16, f16, dtype_of  |
 * | superoffload/handle.hpp     | OwnedHandle, the ownership Pool and Session share                |
 * | superoffload/pool.hpp       | PoolOptions, PoolInfo, Pool, PoolRef                             |
 * | superoffload/kernels.hpp    | Hparams, UpdateOptions, AdamBuffers, adam_update, grad_sumsq ... |
 * | superoffload/ticket.hpp     | Ticket, Timeout, forever, TicketStatus                           |
 * | superoffload/session_types.hpp | SessionOptions, GroupHparams, Slice, StepArgs, StepResult, host_memory() |
 * | superoffload/session.hpp    | Session                                                          |
 * | superoffload/checkpoint.hpp | Session::save / load, SubgroupState, Session::subgroup_state     |
 * | superoffload/cuda.hpp       | CudaOptions, cuda_available(), Session's CUDA calls              |
 *
 * Everything here is `inline` and calls only the C functions, so a program built with this
 * header links against the same `libsuperoffload.so.0.<minor>` as a C program would; the
 * C++ ABI (compiler, standard library, `_GLIBCXX_USE_CXX11_ABI`) never matters. The header
 * keeps no state of its own.
 *
 * The option, argument and result types are the C structs themselves: each derives from its
 * `so_*` struct (initialised by the C `_default()` function, `struct_size` set), so its
 * fields are those documented in `superoffload.h`, and it can be passed wherever C takes a
 * pointer to the struct. The C enumerations have C++ mirrors (`DType::Bf16`, ...) that assign
 * to those fields. What C expresses with a pointer (a core list, the loss scaler's settings,
 * a slice name) these types can own, through set_* functions.
 *
 * Error handling: every function documented as "Throws" raises superoffload::Error, which
 * carries the `so_status` of the failing C call and the message of `so_last_error_message`
 * read right after it. Functions marked `noexcept` never fail.
 *
 * Thread-safety: as the C functions underneath. Kernels may be called from any number of
 * threads at once on disjoint buffers; a Pool may be used from many threads at once, but one
 * Pool object (the handle) must not be moved, reset or destroyed while another thread uses it.
 * The same holds for a Session (whose calls the library serialises).
 *
 * Sessions (superoffload::Session, the `so_session_*` and `so_ticket_*` functions): a wait
 * that times out is not an error. Waiting calls without a Timeout wait forever; with one,
 * they return `bool` or `std::optional`, false or empty when the timeout expired (see
 * superoffload/ticket.hpp).
 *
 * @code
 *   namespace so = superoffload;
 *   if (!so::abi_compatible()) throw std::runtime_error("wrong libsuperoffload");
 *   so::Pool pool = so::Pool::create({16});  // 16 threads, unpinned
 *   so::Hparams hp;                       // torch.optim.AdamW defaults, step 1
 *   so::AdamBuffers bufs(p, g, m, v, n);  // float* p, const so::bf16* g, float* m, float* v
 *   bufs.with_param_copy(p_bf16);         // so::bf16*
 *   so::UpdateOptions opts;
 *   opts.compute_grad_sumsq = true;
 *   double sumsq = *so::adam_update(pool, hp, bufs, opts);
 *
 *   so::SessionOptions so_opts;                 // AdamW, f32 everything, automatic speculation
 *   so_opts.set_pool(pool);
 *   so_opts.grad_dtype = so::DType::Bf16;       // the fields of so_session_options
 *   so::Session session = so::Session::create(so_opts);
 *   std::uint32_t g = session.add_group();       // torch.optim.AdamW defaults
 *   session.add_subgroup(g, master, {{"w", 0, 1000}, {"b", 1000, 10}});  // std::vector<float>
 *   const std::uint32_t w = session.slice_id("w"), b = session.slice_id("b");
 *   session.begin_step();
 *   session.grad_copy(b, grad_b);                // containers of the session's grad dtype
 *   session.grad_copy(w, grad_w);                // completes the sub-group: speculative step
 *   so::StepArgs args;
 *   args.max_norm = 1.0;
 *   const so::StepResult r = session.step_result(session.step(args));
 * @endcode
 */
#ifndef SUPEROFFLOAD_HPP
#define SUPEROFFLOAD_HPP

#include "superoffload/version.hpp"
#include "superoffload/error.hpp"
#include "superoffload/types.hpp"
#include "superoffload/handle.hpp"
#include "superoffload/pool.hpp"
#include "superoffload/kernels.hpp"
#include "superoffload/ticket.hpp"
#include "superoffload/session_types.hpp"
#include "superoffload/session.hpp"
#include "superoffload/checkpoint.hpp"
#include "superoffload/cuda.hpp"

#endif // SUPEROFFLOAD_HPP

// trainstream._C: the pybind11 binding of the C++ client. It takes and returns plain Python values
// and buffers (no torch types), so one build serves every torch version.
//
// Shared-memory regions are exposed as `Region` objects implementing the buffer protocol; each holds
// a reference to its RankSession, so a tensor made with torch.frombuffer keeps the mapping alive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "shm/version.h"
#include "trainstream/client.h"

namespace py = pybind11;
using trainstream::Client;
using trainstream::GpuBuffer;
using trainstream::HostMappedWords;
using trainstream::PinnedHostRange;
using trainstream::RankSession;

namespace {

struct Region {
  std::shared_ptr<RankSession> owner;
  void* data;
  size_t bytes;
};

Region MakeRegion(const std::shared_ptr<RankSession>& session, void* data, size_t bytes) {
  return Region{session, data, bytes};
}

// The GIL is not taken while the interpreter shuts down.
bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// The native waits' interrupt check: with the GIL for a moment, run Python's signal handlers; a
// KeyboardInterrupt (or any exception they raise) leaves the wait as error_already_set, which pybind11
// turns back into that exception. Python runs signal handlers on its main thread only, so elsewhere
// this is a no-op.
void CheckPythonSignals() {
  if (Finalizing()) return;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// A wait's progress message goes to the "trainstream" logger (warning: shown by default).
void LogProgress(const std::string& message) {
  if (Finalizing()) return;
  py::gil_scoped_acquire gil;
  try {
    py::module_::import("logging").attr("getLogger")("trainstream").attr("warning")("%s", message);
  } catch (py::error_already_set&) {  // a broken logging setup must not end the wait
  }
}

std::chrono::milliseconds Milliseconds(double seconds) {
  TS_CHECK(seconds > 0 && seconds <= 1e9, trainstream::Code::kInvalidArgument,
           "wait timeout must be a number of seconds in (0, 1e9], not {}", seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// An RPC's result, called with the GIL released (it may wait for the daemon); converted with it.
template <typename Call>
auto WithoutGil(Call call) {
  py::gil_scoped_release release;
  return call();
}

// A record of the daemon's replies (client.h) as a dict, its fields under their proto names; a list of
// records in it (a StatsReport's jobs and gpus) as a list of dicts.
template <typename T>
concept Record = requires(const T& record) {
  T::VisitFields(record, [](const char*, const auto&) {});
};

template <Record R>
py::dict ToDict(const R& record);

template <typename T>
py::object ToPython(const T& value) {
  if constexpr (requires { requires Record<typename T::value_type>; }) {
    py::list list;
    for (const auto& item : value) list.append(ToDict(item));
    return list;
  } else {
    return py::cast(value);
  }
}

template <Record R>
py::dict ToDict(const R& record) {
  py::dict d;
  R::VisitFields(record, [&d](const char* name, const auto& field) { d[name] = ToPython(field); });
  return d;
}

// A LayoutSpec made with keywords (LayoutSpec(params=[...], num_groups=2)): each goes through its
// property, which refuses a name the spec lacks. Values are checked by the C++ validation at attach.
template <typename Spec>
Spec FromKeywords(const py::kwargs& options) {
  Spec spec;
  const py::object view = py::cast(&spec, py::return_value_policy::reference);
  for (const auto& [name, value] : options) py::setattr(view, name, value);
  return spec;
}

// An enum field of the spec, as its number (the codes _layout.py and _rank.py name).
template <typename Enum, typename Spec, typename Class>
void EnumCode(Class& cls, const char* name, Enum Spec::*field) {
  cls.def_property(
      name, [field](const Spec& spec) { return static_cast<int>(spec.*field); },
      [field, name](Spec& spec, int64_t code) { spec.*field = trainstream::shm::EnumFromCode<Enum>(code, name); });
}

trainstream::shm::StateHalf Half(const RankSession& session, uint32_t half) {
  TS_CHECK(half < 2, trainstream::Code::kInvalidArgument, "state half {} out of range (0 or 1)", half);
  return session.state().halves[half];
}

// One moment (exp_avg or exp_avg_sq) of every parameter, in the job's moment dtype.
Region MomentRegion(const std::shared_ptr<RankSession>& session, void* data) {
  return MakeRegion(session, data, session->layout().total_elems * trainstream::SizeOf(session->spec().moment_dtype));
}

py::list Buckets(const RankSession& session) {
  py::list out;
  for (const auto& bucket : session.layout().buckets) {
    py::dict d;
    d["dtype"] = static_cast<int>(bucket.dtype);
    d["partition"] = bucket.partition;
    d["params"] = bucket.params;
    d["numel"] = bucket.numel;
    d["elem_offset"] = bucket.elem_offset;
    d["upload_offset"] = bucket.upload_offset;
    d["grad_offset"] = bucket.grad_offset;
    d["grads_in_upload"] = bucket.grads_in_upload;
    out.append(d);
  }
  return out;
}

py::list Params(const RankSession& session) {
  py::list out;
  for (const auto& p : session.layout().params) out.append(py::make_tuple(p.bucket, p.offset_in_bucket, p.numel));
  return out;
}

// RankSession::MirrorParamsReady's words from Python: any writable, contiguous buffer of 32-bit words
// (HostMappedWords on a GPU; array.array("I") in the tests), kept alive while the session may write
// it. The reference is dropped with the GIL, or leaked while the interpreter shuts down.
std::shared_ptr<uint32_t> KeepWords(const py::buffer& words, size_t* count) {
  const py::buffer_info info = words.request(/*writable=*/true);
  TS_CHECK(info.ndim == 1 && info.itemsize == 4 && info.strides[0] == 4, trainstream::Code::kInvalidArgument,
           "mirror_params_ready: the words must be one contiguous run of 32-bit unsigned integers "
           "(HostMappedWords, array.array('I')), not {} dimension(s) of {}-byte items",
           info.ndim, info.itemsize);
  *count = static_cast<size_t>(info.shape[0]);
  auto* owner = new py::object(words);
  return {static_cast<uint32_t*>(info.ptr), [owner](uint32_t*) {
            if (Finalizing()) return;
            py::gil_scoped_acquire gil;
            delete owner;
          }};
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "trainstream's C++ client";
  m.attr("__version__") = std::string(trainstream::kVersion);
  m.attr("PROTOCOL_VERSION") = trainstream::kProtocolVersion;
  static py::exception<trainstream::Error> error(m, "TrainstreamError", PyExc_RuntimeError);
  py::register_exception_translator(
      [](std::exception_ptr p) {  // NOLINT(performance-unnecessary-value-param): pybind11 fixes the signature
        try {
          if (p) std::rethrow_exception(p);
        } catch (const trainstream::Error& e) {
          py::set_error(error, e.what());
        }
      });

  py::class_<Region>(m, "Region", py::buffer_protocol())
      .def_buffer([](Region& r) -> py::buffer_info {
        return py::buffer_info(r.data, 1, py::format_descriptor<uint8_t>::format(), 1, {r.bytes}, {1});
      })
      .def_property_readonly("nbytes", [](const Region& r) { return r.bytes; })
      .def_property_readonly("address", [](const Region& r) { return reinterpret_cast<uintptr_t>(r.data); });

  // A job's specification (shm/job_layout.h), as the client sends it: ValidateRequest checks it at attach.
  using trainstream::shm::LayoutSpec;
  using trainstream::shm::ParamSpec;
  py::class_<ParamSpec> param_spec(m, "ParamSpec");
  param_spec
      .def(
          py::init([](std::string name, std::vector<int64_t> shape, int64_t dtype, uint32_t group, uint32_t partition) {
            return ParamSpec{.name = std::move(name),
                             .shape = std::move(shape),
                             .dtype = trainstream::shm::EnumFromCode<trainstream::DType>(dtype, "dtype"),
                             .group = group,
                             .partition = partition};
          }),
          py::arg("name"), py::arg("shape"), py::arg("dtype"), py::arg("group") = 0, py::arg("partition") = 0)
      .def_readwrite("name", &ParamSpec::name)
      .def_readwrite("shape", &ParamSpec::shape)
      .def_readwrite("group", &ParamSpec::group)
      .def_readwrite("partition", &ParamSpec::partition);
  EnumCode(param_spec, "dtype", &ParamSpec::dtype);

  py::class_<LayoutSpec> layout_spec(m, "LayoutSpec");
  layout_spec.def(py::init(&FromKeywords<LayoutSpec>))
      .def_readwrite("params", &LayoutSpec::params)
      .def_readwrite("frozen", &LayoutSpec::frozen)
      .def_readwrite("num_groups", &LayoutSpec::num_groups)
      .def_readwrite("bucket_bytes", &LayoutSpec::bucket_bytes)
      .def_readwrite("accumulation_steps", &LayoutSpec::accumulation_steps)
      .def_readwrite("world_size", &LayoutSpec::world_size)
      .def_readwrite("max_grad_norm", &LayoutSpec::max_grad_norm)
      .def_readwrite("step_terms", &LayoutSpec::step_terms)
      .def_readwrite("peers", &LayoutSpec::peers)
      .def_readwrite("node_rank", &LayoutSpec::node_rank)
      .def_readwrite("state_halves", &LayoutSpec::state_halves);
  EnumCode(layout_spec, "moment_dtype", &LayoutSpec::moment_dtype);
  EnumCode(layout_spec, "optimizer", &LayoutSpec::optimizer);
  EnumCode(layout_spec, "speculative_clipping", &LayoutSpec::speculative_clipping);
  m.attr("MIN_BUCKET_BYTES") = trainstream::shm::kMinBucketBytes;
  m.attr("MAX_ACCUMULATION_STEPS") = trainstream::shm::kMaxAccumulationSteps;

  py::class_<Client, std::shared_ptr<Client>>(m, "Client")
      .def_static(
          "connect",
          [](const std::string& path, double timeout_s, double wait_timeout_s) {
            trainstream::WaitPolicy waits{
                .timeout = Milliseconds(wait_timeout_s), .interrupt = CheckPythonSignals, .progress = LogProgress};
            py::gil_scoped_release release;
            return Client::Connect(path, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)),
                                   std::move(waits));
          },
          py::arg("socket_path"), py::arg("timeout_s") = 5.0, py::arg("wait_timeout_s") = 300.0)
      .def_property_readonly("socket_path", &Client::socket_path)
      .def_property_readonly("info", [](const Client& c) { return ToDict(c.info()); })
      .def("ping", [](Client& c) { return ToDict(WithoutGil([&] { return c.Ping(); })); })
      .def("stats", [](Client& c) { return ToDict(WithoutGil([&] { return c.Stats(); })); })
      .def(
          "drop_job",
          [](Client& c, const std::string& job, bool force, std::optional<uint32_t> uid) {
            c.DropJob(job, force, uid);
          },
          py::arg("job"), py::arg("force") = false, py::arg("uid") = py::none(),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "attach",
          [](Client& c, const std::string& job, uint32_t rank, const trainstream::shm::LayoutSpec& spec, uint64_t seed,
             const std::string& transport, const std::string& device, std::optional<double> wait_timeout_s) {
            std::optional<std::chrono::milliseconds> wait_timeout;
            if (wait_timeout_s) wait_timeout = Milliseconds(*wait_timeout_s);
            py::gil_scoped_release release;
            return std::shared_ptr<RankSession>(
                c.Attach(job, rank, spec, seed, trainstream::RankTransport{transport, device}, wait_timeout));
          },
          py::arg("job"), py::arg("rank"), py::arg("spec"), py::arg("seed"), py::arg("transport") = "host",
          py::arg("device") = "cpu", py::arg("wait_timeout_s") = py::none());

  // Device memory for the cuda-ipc transport; torch.as_tensor(buffer, device=...) views it through
  // __cuda_array_interface__, and the tensor keeps the buffer alive.
  py::class_<GpuBuffer, std::shared_ptr<GpuBuffer>>(m, "GpuBuffer")
      .def(py::init<int, size_t>(), py::arg("device"), py::arg("nbytes"))
      .def_property_readonly("address", &GpuBuffer::address)
      .def_property_readonly("nbytes", &GpuBuffer::bytes)
      .def("ipc_handle", [](const GpuBuffer& b) { return py::bytes(b.ipc_handle()); })
      .def_property_readonly("__cuda_array_interface__", [](const GpuBuffer& b) {
        py::dict interface;
        interface["shape"] = py::make_tuple(b.bytes());
        interface["typestr"] = "|u1";
        interface["data"] = py::make_tuple(b.address(), false);
        interface["version"] = 2;
        return interface;
      });

  // Page-locked host memory (weight paging's host copies): the constructor releases the GIL, so that
  // several threads can register ranges at once.
  py::class_<PinnedHostRange, std::shared_ptr<PinnedHostRange>>(m, "PinnedHostRange")
      .def(py::init<int, uint64_t, size_t>(), py::arg("device"), py::arg("address"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("address", &PinnedHostRange::address)
      .def_property_readonly("nbytes", &PinnedHostRange::bytes);

  // Host words that the GPU's streams wait on (weights waited for on the GPU): a buffer of uint32.
  py::class_<HostMappedWords, std::shared_ptr<HostMappedWords>>(m, "HostMappedWords", py::buffer_protocol())
      .def(py::init<int, size_t>(), py::arg("device"), py::arg("count"))
      .def("queue_wait", &HostMappedWords::QueueWait, py::arg("stream"), py::arg("index"), py::arg("value"))
      .def_buffer([](HostMappedWords& w) -> py::buffer_info {
        return {w.words(), sizeof(uint32_t), py::format_descriptor<uint32_t>::format(),
                static_cast<py::ssize_t>(w.count())};
      });

  py::class_<RankSession, std::shared_ptr<RankSession>>(m, "RankSession")
      .def_property_readonly("rank", &RankSession::rank)
      .def_property_readonly("created", &RankSession::created)
      .def_property_readonly("initialized", &RankSession::initialized)
      .def_property_readonly("completed_step", &RankSession::completed_step)
      .def_property_readonly("resume_step", &RankSession::resume_step)
      .def_property_readonly("buckets", &Buckets)
      .def_property_readonly("params", &Params)
      .def_property_readonly("total_elems", [](const RankSession& s) { return s.layout().total_elems; })
      .def_property_readonly("layout_hash", [](const RankSession& s) { return s.layout().hash; })
      .def("applied_step", &RankSession::applied_step)
      // The state regions of one half (0 or 1; with one half, 1 names 0's memory): a bucket's weights
      // are those of its committed half.
      .def(
          "master",
          [](const std::shared_ptr<RankSession>& s, uint32_t half) {
            return MakeRegion(s, Half(*s, half).master, s->layout().total_elems * sizeof(float));
          },
          py::arg("half") = 0)
      .def(
          "exp_avg",
          [](const std::shared_ptr<RankSession>& s, uint32_t half) { return MomentRegion(s, Half(*s, half).exp_avg); },
          py::arg("half") = 0)
      .def(
          "exp_avg_sq",
          [](const std::shared_ptr<RankSession>& s, uint32_t half) {
            return MomentRegion(s, Half(*s, half).exp_avg_sq);
          },
          py::arg("half") = 0)
      .def_property_readonly("state_halves", [](const RankSession& s) { return s.layout().state_halves; })
      .def("committed_half", &RankSession::committed_half, py::arg("bucket"))
      .def("upload",
           [](const std::shared_ptr<RankSession>& s) {
             return MakeRegion(s, s->state().upload, s->layout().upload_bytes);
           })
      .def("frozen",
           [](const std::shared_ptr<RankSession>& s) {
             return MakeRegion(s, s->state().frozen, s->layout().frozen_bytes);
           })
      .def_property_readonly("frozen_offsets", [](const RankSession& s) { return s.layout().frozen_offsets; })
      .def("grads",
           [](const std::shared_ptr<RankSession>& s) { return MakeRegion(s, s->view().grads, s->layout().grad_bytes); })
      .def("presence",
           [](const std::shared_ptr<RankSession>& s) {
             return MakeRegion(s, s->view().presence, s->spec().params.size());
           })
      .def(
          "param_steps",
          [](const std::shared_ptr<RankSession>& s, uint32_t half) {
            return MakeRegion(s, Half(*s, half).param_state,
                              s->spec().params.size() * sizeof(trainstream::shm::ParamState));
          },
          py::arg("half") = 0)
      .def(
          "set_hparams",
          [](RankSession& s, uint64_t step, uint32_t group, double lr, double beta1, double beta2, double eps,
             double weight_decay) {
            TS_CHECK(group < s.spec().num_groups, trainstream::Code::kInvalidArgument, "group {} out of range", group);
            s.view().hparams[(step % 2) * s.spec().num_groups + group] =
                trainstream::shm::HParams{lr, beta1, beta2, eps, weight_decay};
          },
          py::arg("step"), py::arg("group"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"))
      .def_property_readonly("grad_bytes", [](const RankSession& s) { return s.layout().grad_bytes; })
      .def(
          "send_grad_ready",
          [](RankSession& s, uint32_t bucket, uint64_t step, uint32_t micro, int last, uint32_t slot, uint32_t piece) {
            TS_CHECK(last >= 0 && last <= 2, trainstream::Code::kInvalidArgument,
                     "last {} (0: not the step's last micro-batch, 1: its last, 2: not known)", last);
            s.SendGradReady(bucket, step, micro, static_cast<RankSession::Last>(last), slot, piece);
          },
          py::arg("bucket"), py::arg("step"), py::arg("micro"), py::arg("last"), py::arg("slot") = 0,
          py::arg("piece") = 0, py::call_guard<py::gil_scoped_release>())
      .def("send_norm_terms", &RankSession::SendNormTerms, py::arg("step"), py::arg("micro_batches"),
           py::arg("norm_factor"), py::arg("max_norm"), py::call_guard<py::gil_scoped_release>())
      .def("send_commit_terms", &RankSession::SendCommitTerms, py::arg("step"), py::arg("micro_batches"),
           py::arg("factor"), py::call_guard<py::gil_scoped_release>())
      .def("send_more_micro", &RankSession::SendMoreMicro, py::arg("step"), py::arg("micro"),
           py::call_guard<py::gil_scoped_release>())
      .def("discard", &RankSession::Discard, py::arg("step"), py::arg("count"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "wait_step_norm",
          [](RankSession& s, uint64_t step) {
            RankSession::Norm norm;
            {
              py::gil_scoped_release release;
              norm = s.WaitStepNorm(step);
            }
            return py::make_tuple(norm.value, norm.nonfinite);
          },
          py::arg("step"))
      .def(
          "register_cuda_ipc",
          [](RankSession& s, const py::bytes& device_uuid, const py::bytes& params_handle, uint64_t params_bytes,
             const py::bytes& staging_handle, uint64_t slot_bytes, const std::vector<py::bytes>& grad_ready_events,
             const std::vector<py::bytes>& weights_wanted_events, std::vector<uint64_t> param_offsets) {
            trainstream::CudaIpcBuffers buffers{.device_uuid = device_uuid,
                                                .params_handle = params_handle,
                                                .params_bytes = params_bytes,
                                                .staging_handle = staging_handle,
                                                .slot_bytes = slot_bytes,
                                                .grad_ready_events = {},
                                                .weights_wanted_events = {},
                                                .param_offsets = std::move(param_offsets)};
            for (const auto& event : grad_ready_events) buffers.grad_ready_events.emplace_back(event);
            for (const auto& event : weights_wanted_events) buffers.weights_wanted_events.emplace_back(event);
            py::gil_scoped_release release;
            return s.RegisterCudaIpc(buffers);
          },
          py::arg("device_uuid"), py::arg("params_handle"), py::arg("params_bytes"), py::arg("staging_handle"),
          py::arg("slot_bytes"), py::arg("grad_ready_events"), py::arg("weights_wanted_events"),
          py::arg("param_offsets") = std::vector<uint64_t>())
      .def("send_weights_wanted", &RankSession::SendWeightsWanted, py::arg("step"), py::arg("event"),
           py::arg("weights_on_gpu") = false, py::call_guard<py::gil_scoped_release>())
      .def("wait_staging_free", &RankSession::WaitStagingFree, py::arg("slot"),
           py::call_guard<py::gil_scoped_release>())
      .def("wait_weights_wanted_waits", &RankSession::WaitWeightsWantedWaits, py::arg("count"),
           py::call_guard<py::gil_scoped_release>())
      .def("send_load_state", &RankSession::SendLoadState, py::arg("step"), py::call_guard<py::gil_scoped_release>())
      .def(
          "send_raw",
          [](RankSession& s, int kind, int flags, uint32_t bucket, uint64_t step, uint32_t micro) {
            trainstream::shm::Message message;
            message.kind = static_cast<trainstream::shm::MessageKind>(kind);
            message.flags = static_cast<uint16_t>(flags);
            message.bucket = bucket;
            message.step = step;
            message.micro = micro;
            py::gil_scoped_release release;
            s.SendRaw(message);
          },
          py::arg("kind"), py::arg("flags"), py::arg("bucket"), py::arg("step"), py::arg("micro"))
      .def("wait_params_ready", &RankSession::WaitParamsReady, py::arg("bucket"), py::arg("step"),
           py::call_guard<py::gil_scoped_release>())
      .def("wait_slot_free", &RankSession::WaitSlotFree, py::arg("bucket"), py::call_guard<py::gil_scoped_release>())
      .def("params_ready", &RankSession::ParamsReady, py::arg("bucket"), py::arg("step"))
      .def(
          "mirror_params_ready",
          [](RankSession& s, const py::buffer& words) {
            size_t count = 0;
            std::shared_ptr<uint32_t> kept = KeepWords(words, &count);
            s.MirrorParamsReady(std::move(kept), count);
          },
          py::arg("words"))
      .def("expect_params_ready", &RankSession::ExpectParamsReady, py::arg("bucket"), py::arg("step"))
      .def_property_readonly_static("words_released", [](const py::object&) { return RankSession::kWordsReleased; })
      .def("check_healthy", &RankSession::CheckHealthy)
      .def("take_warnings", &RankSession::TakeWarnings)
      .def("close", &RankSession::Close, py::call_guard<py::gil_scoped_release>());
}

// The test accelerator "sim": N simulated devices in host memory, registered as PyTorch's PrivateUse1 backend.
//
// Test infrastructure for dist_resume (never part of the installed package). What it gives torch: a device type with
// N indices (DIST_RESUME_SIM_DEVICES, read once at load, default 2), a per-device allocator whose byte counters feed
// torch.accelerator.memory_allocated(i), a thread-local current device, per-device CPU generators, a pinned host
// allocator, a few kernels of its own and a boxed fallback that refuses mixed devices with torch's own wording and
// otherwise runs the operator on the CPU. Python (tests/accelerator) renames PrivateUse1 to "sim" and switches the
// devices on and off at run time through the sim_backend:: operators at the bottom.
//
// Pinned to torch 2.13: it uses unstable headers (ATen/ops/*_native.h, ATen/native/CPUFallback.h, the hooks and
// allocator interfaces). A new torch version means rebuilding and rerunning tests/accelerator/test_sim_backend.py.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_set>
#include <vector>

namespace {

using c10::DeviceIndex;
using c10::DeviceType;
constexpr DeviceType kSim = DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

int devices_at_load() {
  const char* text = std::getenv("DIST_RESUME_SIM_DEVICES");
  const int n = text ? std::atoi(text) : 2;
  return (n >= 1 && n <= kMaxDevices) ? n : 2;
}

const int g_devices = devices_at_load();   // how many indices exist in this process
std::atomic<int> g_enabled{g_devices};     // how many of them are usable now (0: the accelerator is "off")
thread_local DeviceIndex t_current = 0;     // this thread's current device, as cudaSetDevice keeps it

void check_index(DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < g_devices, "sim error: invalid device ordinal ", int(index), " (this process has ",
              g_devices, " sim devices; DIST_RESUME_SIM_DEVICES sets the number before the library loads)");
}

void check_enabled(DeviceIndex index) {
  const int enabled = g_enabled.load();
  TORCH_CHECK(enabled > 0, "sim:", int(index), " requested but the test accelerator is disabled (",
              "torch.accelerator.is_available() is False); enable it with tests.accelerator.enabled()");
  TORCH_CHECK(index >= 0 && index < enabled, "sim error: invalid device ordinal ", int(index), " (", enabled,
              " sim device(s) enabled)");
}

// ---- memory: host memory, counted per device --------------------------------------------------------------------

struct Block {
  void* ptr;
  size_t size;
  DeviceIndex device;
};

struct SimAllocator final : c10::DeviceAllocator {
  std::mutex mutex;
  std::vector<c10::CachingDeviceAllocator::DeviceStats> stats{static_cast<size_t>(g_devices)};

  void count(DeviceIndex device, size_t size, bool alloc) {
    std::lock_guard<std::mutex> lock(mutex);
    auto& s = stats[device];
    for (auto* stat : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.requested_bytes}) {
      auto& all = (*stat)[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      alloc ? all.increase(size) : all.decrease(size);
    }
    for (auto* stat : {&s.allocation, &s.segment, &s.active}) {
      auto& all = (*stat)[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      alloc ? all.increase(1) : all.decrease(1);
    }
  }

  static void release(void* ctx);

  c10::DataPtr allocate(size_t size) override {
    const DeviceIndex device = t_current;  // callers hold a device guard, as with CUDA's caching allocator
    check_enabled(device);
    void* ptr = size ? c10::alloc_cpu(size) : nullptr;
    count(device, size, true);
    return {ptr, new Block{ptr, size, device}, &SimAllocator::release, c10::Device(kSim, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t /*pool*/) override {}
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex);
    return stats[device];
  }
  template <typename F>
  void each_stat(DeviceIndex device, F reset) {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex);
    auto& s = stats[device];
    for (auto* stat : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.requested_bytes, &s.allocation,
                       &s.segment, &s.active}) {
      for (auto& one : *stat) reset(one);
    }
  }
  void resetAccumulatedStats(DeviceIndex d) override { each_stat(d, [](auto& one) { one.reset_accumulated(); }); }
  void resetPeakStats(DeviceIndex d) override { each_stat(d, [](auto& one) { one.reset_peak(); }); }
};

SimAllocator g_allocator;

void SimAllocator::release(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  g_allocator.count(block->device, block->size, false);
  c10::free_cpu(block->ptr);
  delete block;
}

// Pinned memory: ordinary host memory that remembers it was pinned (tensor.is_pinned() asks isPinnedPtr).
struct PinnedAllocator final : c10::Allocator {
  std::mutex mutex;
  std::unordered_set<void*> live;

  static void release(void* ptr);

  c10::DataPtr allocate(size_t size) override {
    TORCH_CHECK(g_enabled.load() > 0, "cannot pin memory: the test accelerator is disabled");
    if (size == 0) return {nullptr, c10::Device(DeviceType::CPU)};
    void* ptr = c10::alloc_cpu(size);
    {
      std::lock_guard<std::mutex> lock(mutex);
      live.insert(ptr);
    }
    return {ptr, ptr, &PinnedAllocator::release, c10::Device(DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &PinnedAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  bool is_pinned(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex);
    return live.count(const_cast<void*>(ptr)) > 0;
  }
};

PinnedAllocator g_pinned;

void PinnedAllocator::release(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(g_pinned.mutex);
    g_pinned.live.erase(ptr);
  }
  c10::free_cpu(ptr);
}

// ---- device guard: a thread-local current device; streams and events are no-ops (everything is synchronous) -----

struct SimGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return kSim; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const DeviceIndex old = t_current;
    if (d.index() >= 0) setDevice(d);
    return {kSim, old};
  }
  c10::Device getDevice() const override { return {kSim, t_current}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kSim, "expected a sim device, got ", d);
    check_index(d.index());
    t_current = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_current = d.index(); }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return getStream(d); }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override { return getStream(d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high*/) const override { return getStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return s; }
  // All indices, enabled or not: the autograd engine sizes its device threads from this once, at its first backward.
  DeviceIndex deviceCount() const noexcept override { return static_cast<DeviceIndex>(g_devices); }
  void record(void** event, const c10::Stream& /*stream*/, const DeviceIndex /*device*/,
              const c10::EventFlag /*flag*/) const override {
    static int recorded = 0;
    *event = &recorded;  // any non-null handle: every event is complete as soon as it is recorded
  }
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* /*event*/, const DeviceIndex /*device*/) const noexcept override {}
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const DeviceIndex /*device*/) const override {}
  double elapsedTime(void* /*a*/, void* /*b*/, const DeviceIndex /*device*/) const override { return 0.0; }
  c10::DeviceCapability getDeviceCapability(c10::Device /*device*/) const override { return {}; }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, SimGuard);

// ---- hooks: availability, generators, pinned memory --------------------------------------------------------------

std::vector<at::Generator> make_generators() {
  std::vector<at::Generator> gens;
  for (int i = 0; i < g_devices; ++i) gens.push_back(at::detail::createCPUGenerator(c10::default_rng_seed_val));
  return gens;
}

std::vector<at::Generator>& generators() {
  static std::vector<at::Generator> gens = make_generators();
  return gens;
}

const at::Generator& default_generator(DeviceIndex device) {
  const DeviceIndex index = device < 0 ? t_current : device;
  check_index(index);
  return generators()[index];
}

struct SimHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_enabled.load() > 0; }
  bool hasPrimaryContext(DeviceIndex /*device*/) const override { return true; }
  DeviceIndex deviceCount() const override { return static_cast<DeviceIndex>(g_enabled.load()); }
  void setCurrentDevice(DeviceIndex device) const override { SimGuard().setDevice({kSim, device}); }
  DeviceIndex getCurrentDevice() const override { return t_current; }
  DeviceIndex exchangeDevice(DeviceIndex device) const override {
    return SimGuard().exchangeDevice({kSim, device}).index();
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex device) const override { return exchangeDevice(device); }
  const at::Generator& getDefaultGenerator(DeviceIndex device) const override { return default_generator(device); }
  at::Generator getNewGenerator(DeviceIndex /*device*/) const override {
    return at::detail::createCPUGenerator(c10::default_rng_seed_val);
  }
  at::Device getDeviceFromPtr(void* /*data*/) const override {
    TORCH_CHECK(false, "sim: a raw pointer does not say which sim device it belongs to; pass the device explicitly");
  }
  bool isPinnedPtr(const void* data) const override { return g_pinned.is_pinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t size) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    c10::DeviceGuard guard(impl->device());
    at::DataPtr fresh = g_allocator.allocate(size);
    const size_t keep = std::min(size, impl->nbytes());
    if (keep > 0) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(size);
  }
};

// ---- kernels -------------------------------------------------------------------------------------------------------

c10::Device device_or_current(std::optional<c10::Device> device) {
  const c10::Device d = device.value_or(c10::Device(kSim));
  TORCH_CHECK(d.type() == kSim, "expected a sim device, got ", d);
  return d.has_index() ? d : c10::Device(kSim, t_current);
}

at::Tensor sim_empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                     std::optional<c10::Device> device, std::optional<bool> pin_memory,
                     std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(layout.value_or(at::kStrided) == at::kStrided, "sim: only strided tensors are supported");
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned");
  c10::DeviceGuard guard(device_or_current(device));
  return at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor sim_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout> layout, std::optional<c10::Device> device,
                             std::optional<bool> pin_memory) {
  TORCH_CHECK(layout.value_or(at::kStrided) == at::kStrided, "sim: only strided tensors are supported");
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned");
  c10::DeviceGuard guard(device_or_current(device));
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// The same bytes seen as a CPU tensor (all sim memory is host memory), so CPU kernels can read and write it.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  TORCH_CHECK(t.device().type() == kSim, "sim: cannot copy to or from ", t.device());
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor sim_copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  if (self.numel() == 0) return dst;
  const at::Tensor src = self.resolve_conj().resolve_neg();
  host_alias(dst).copy_(host_alias(src));
  return dst;
}

at::Tensor sim_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return sim_copy_from(self, dst, false);
}

at::Scalar sim_local_scalar_dense(const at::Tensor& self) { return at::_local_scalar_dense(host_alias(self)); }

const at::Tensor& sim_resize_(const at::Tensor& self, c10::IntArrayRef size,
                              std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());  // a grown storage is allocated on the tensor's own device
  return at::native::resize_(self, size, memory_format);
}

at::Tensor& sim_set_storage(at::Tensor& self, at::Storage source, int64_t offset, c10::IntArrayRef size,
                            c10::IntArrayRef stride) {
  c10::DeviceGuard guard(self.device());
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& sim_set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  at::Storage storage(at::Storage::use_byte_size_t(), 0, &g_allocator, /*resizable=*/true);
  return at::native::set_storage_cpu_(self, std::move(storage), 0, {0}, {});
}

void sim_record_stream(at::Tensor& /*self*/, c10::Stream /*stream*/) {}  // one stream per device: nothing to order

// Every other operator: refuse mixed devices with TensorIterator's rule and words (the common device is the first
// non-CPU one; 0-dim CPU tensors are scalars and allowed), then run the CPU kernel; cpu_fallback copies the results
// back. Random operators draw from the sim device's own generator.
std::optional<c10::Device> common_device(const std::vector<c10::Device>& devices) {
  std::optional<c10::Device> common;
  for (const c10::Device& d : devices) {
    if (!common || (common->is_cpu() && !d.is_cpu())) common = d;
    if (!common->is_cpu()) break;
  }
  for (const c10::Device& d : devices) {
    TORCH_CHECK(d == *common, "Expected all tensors to be on the same device, but found at least two devices, ",
                *common, " and ", d, "!");
  }
  return common;
}

void add_device(const at::Tensor& t, std::vector<c10::Device>& devices) {
  if (t.defined() && !(t.is_cpu() && t.dim() == 0)) devices.push_back(t.device());
}

bool is_generator_arg(const c10::Argument& arg) {
  c10::TypePtr type = arg.type();
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  return type->kind() == c10::TypeKind::GeneratorType;
}

void sim_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<c10::Device> devices;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (value.isTensor()) {
      add_device(value.toTensor(), devices);
    } else if (value.isTensorList() || value.isOptionalTensorList()) {
      for (const c10::IValue& item : value.toListRef()) {
        if (item.isTensor()) add_device(item.toTensor(), devices);
      }
    }
  }
  const std::optional<c10::Device> common = common_device(devices);
  const bool on_sim = common && common->type() == kSim;
  if (on_sim) {
    for (size_t i = 0; i < args.size(); ++i) {
      if (is_generator_arg(args[i]) && (*stack)[first + i].isNone()) {
        (*stack)[first + i] = c10::IValue(default_generator(common->index()));
      }
    }
  }
  c10::OptionalDeviceGuard guard(common);
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
  if (!on_sim) return;
  // cpu_fallback sends results to the first tensor argument's device; when that was a 0-dim CPU scalar, move them.
  const size_t n_returns = op.schema().returns().size();
  for (size_t i = stack->size() - n_returns; i < stack->size(); ++i) {
    c10::IValue& result = (*stack)[i];
    if (result.isTensor() && result.toTensor().is_cpu()) result = c10::IValue(result.toTensor().to(*common));
  }
}

// ---- control from Python: tests.accelerator reads and sets these --------------------------------------------------

void set_enabled(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= g_devices, "sim: cannot enable ", n, " devices: this process has ", g_devices,
              " (DIST_RESUME_SIM_DEVICES is read once, when the library loads)");
  g_enabled.store(static_cast<int>(n));
}

template <typename F>
auto with_generator(int64_t device, F use) {  // under the generator's lock, as torch.cuda's RNG functions
  at::Generator gen = default_generator(static_cast<DeviceIndex>(device));
  std::lock_guard<std::mutex> lock(gen.mutex());
  return use(gen);
}

at::Tensor get_rng_state(int64_t device) {
  return with_generator(device, [](at::Generator& gen) { return gen.get_state(); });
}
void set_rng_state(int64_t device, const at::Tensor& state) {
  with_generator(device, [&](at::Generator& gen) { gen.set_state(state); });
}
void manual_seed(int64_t device, int64_t seed) {
  with_generator(device, [&](at::Generator& gen) { gen.set_current_seed(static_cast<uint64_t>(seed)); });
}
int64_t initial_seed(int64_t device) {
  return with_generator(device, [](at::Generator& gen) { return static_cast<int64_t>(gen.current_seed()); });
}

struct Registration {
  Registration() {
    c10::SetAllocator(kSim, &g_allocator);
    at::RegisterPrivateUse1HooksInterface(new SimHooks());  // lives as long as the process, as torch expects
  }
};
const Registration g_registration;

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(sim_empty));
  m.impl("empty_strided", TORCH_FN(sim_empty_strided));
  m.impl("_copy_from", TORCH_FN(sim_copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(sim_copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(sim_local_scalar_dense));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("resize_", TORCH_FN(sim_resize_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(sim_set_storage));
  m.impl("set_.source_Storage", TORCH_FN(at::native::set_));
  m.impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  m.impl("set_", TORCH_FN(sim_set_empty));
  m.impl("record_stream", TORCH_FN(sim_record_stream));
  // Its CompositeExplicitAutogradNonFunctional kernel (which outranks a fallback) hands the CPU out= kernel a 0-dim
  // output that kernel first resizes to the inputs' shape: a correct result with a UserWarning on every call.
  m.impl("mse_loss", torch::CppFunction::makeFromBoxedFunction<&sim_fallback>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&sim_fallback>()); }

TORCH_LIBRARY(sim_backend, m) {
  m.def("device_count_at_load() -> int", [] { return static_cast<int64_t>(g_devices); });
  m.def("enabled_devices() -> int", [] { return static_cast<int64_t>(g_enabled.load()); });
  m.def("set_enabled_devices(int n) -> ()", &set_enabled);
  m.def("get_rng_state(int device) -> Tensor", &get_rng_state);
  m.def("set_rng_state(int device, Tensor state) -> ()", &set_rng_state);
  m.def("manual_seed(int device, int seed) -> ()", &manual_seed);
  m.def("initial_seed(int device) -> int", &initial_seed);
}

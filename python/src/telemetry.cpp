// Bindings of kiln/telemetry: one sample of a device (memory, utilization, power, clocks,
// temperature, kiln's allocator figures) as the JSON text of telemetry::to_json (the package
// turns it into a dict), and the devices this process can sample.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "kiln/telemetry/telemetry.h"
#include "python/src/bindings.h"

namespace kiln::python {

void bind_telemetry(nb::module_& m) {
  m.def("telemetry_sample", [](const std::string& device) {
    const Device d = Device::parse(device);
    nb::gil_scoped_release nogil;  // a CPU sample may wait out the minimum interval (0.1 s)
    return telemetry::to_json(telemetry::sample(d)).dump();
  }, nb::arg("device") = "cpu");
  m.def("telemetry_devices", [] {
    std::vector<std::string> out;
    for (const Device& d : telemetry::all_devices()) out.push_back(d.str());
    return out;
  });
}

}  // namespace kiln::python

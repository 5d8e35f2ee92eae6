#include "daemon/systemd_notify.h"

#ifdef TRAINSTREAM_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

namespace trainstream::daemon {

void NotifySystemd(const char* state) {
#ifdef TRAINSTREAM_HAVE_SYSTEMD
  sd_notify(0, state);
#else
  (void)state;
#endif
}

}  // namespace trainstream::daemon

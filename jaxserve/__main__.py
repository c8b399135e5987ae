from jaxserve.generate import main

raise SystemExit(main())
